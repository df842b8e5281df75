"""Real process-group entry of the expert-parallel MoE kernels (kosmos.kernels.moe_ep forward, moe_ep_backward):
one rank per process on the group's symmetric-memory workspace (runtime.group_workspace), rank_base = the group
rank, this rank's tensors given a leading dim of 1 and the outputs squeezed. kosmos.kernels.moe_ops decides which
calls come here; every rank of the group must make the same call with the same token count T (the kernels size the
receive regions by it, and a workspace grows collectively).

    out, logits, tokens_per_expert = moe_ep_forward_group(hidden, router_weight, ..., return_router_logits, group)
    grads = moe_ep_backward_group(grad_out, grad_router_logits, hidden, router_weight, ..., activation, group)

Keyword-only test hooks pass through to the kernels: programs, config, straggler=(rank, ns) (that rank waits inside
the kernel), drop_signal=(rank, task) (that task releases nothing: its consumers time out); ws and rank replace the
group's workspace and rank (the interpreter tests drive a SimWorld workspace's rank view).
"""
from __future__ import annotations

from typing import Optional

import torch

from kosmos.kernels import runtime


def _workspace(group_name: Optional[str], device: torch.device, ws, rank):
    if ws is None:
        ws = runtime.group_workspace(group_name, device)
    if rank is None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        rank = dist.get_rank(_resolve_process_group(group_name))
    if ws.n_local != 1:
        raise ValueError(f"kosmos moe_layer (EP): a group's workspace drives one rank, got {ws.n_local}")
    return ws, rank


def moe_ep_forward_group(hidden: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                         score_correction_bias: Optional[torch.Tensor], gate_up_proj: torch.Tensor,
                         down_proj: torch.Tensor, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True,
                         n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                         router_dtype: Optional[torch.dtype] = None, activation: str = "silu",
                         return_router_logits: bool = False, group_name: Optional[str] = None, *, ws=None,
                         rank: Optional[int] = None, programs: Optional[int] = None, config=None, straggler=None,
                         drop_signal=None, return_routing: bool = False, weights_dtype: Optional[torch.dtype] = None):
    """kosmos::moe_layer's EP forward of this rank: hidden [T, H] (its tokens), gate_up_proj [E_loc, 2I, H] and
    down_proj [E_loc, H, I] (its experts) -> (out [T, H], router_logits [T or 0, E], tokens_per_expert [E] int32,
    global) (+ (topk_ids, topk_weights) [T, k] with return_routing). weights_dtype: as moe_ep.moe_ep_forward."""
    from kosmos.kernels.moe_ep import moe_ep_forward

    ws, rank = _workspace(group_name, hidden.device, ws, rank)
    res = moe_ep_forward(ws, rank, hidden[None], router_weight, router_bias, score_correction_bias, gate_up_proj[None],
                         down_proj[None], top_k, scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor,
                         router_dtype, activation, return_router_logits, programs=programs, config=config,
                         straggler=straggler, drop_signal=drop_signal, return_routing=return_routing,
                         weights_dtype=weights_dtype)
    return tuple(t[0] for t in res)


def moe_ep_backward_group(grad_out: torch.Tensor, grad_router_logits: Optional[torch.Tensor], hidden: torch.Tensor,
                          router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
                          score_correction_bias: Optional[torch.Tensor], gate_up_proj: torch.Tensor,
                          down_proj: torch.Tensor, top_k: int, scoring: str = "softmax", norm_topk_prob: bool = True,
                          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                          router_dtype: Optional[torch.dtype] = None, activation: str = "silu",
                          group_name: Optional[str] = None, *, ws=None, rank: Optional[int] = None,
                          programs: Optional[int] = None, config=None, straggler=None, drop_signal=None):
    """kosmos::moe_layer_backward's EP backward of this rank (shapes as moe_ep_forward_group; grad_out [T, H],
    grad_router_logits [T, E] or None) -> [d_hidden, d_router_weight, d_gate_up_proj, d_down_proj]
    (+ [d_router_bias]): this rank's share, as the op's reference impl."""
    from kosmos.kernels.moe_ep_backward import moe_ep_backward

    ws, rank = _workspace(group_name, hidden.device, ws, rank)
    grads = moe_ep_backward(ws, rank, grad_out[None], grad_router_logits[None] if grad_router_logits is not None
                            else None, hidden[None], router_weight, router_bias, score_correction_bias,
                            gate_up_proj[None], down_proj[None], top_k, scoring, norm_topk_prob, n_group, topk_group,
                            routed_scaling_factor, router_dtype, activation, programs=programs, config=config,
                            straggler=straggler, drop_signal=drop_signal)
    return [g[0] for g in grads]
