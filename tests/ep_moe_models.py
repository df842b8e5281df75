"""Expert-parallel MoE forms that carry their own collectives, for the tests of kosmos/passes/moe_ep_forms.py.

    TitanEpMoE(dim, hidden, num_experts, top_k, group)   # torchtitan-style all-to-all EP (token counts exchanged)
    hf_ep_model(impl, mesh) / hf_ep_moe_block(impl, mesh)  # transformers' own EP ("all_reduce" / "all_to_all"), or None

TitanEpMoE follows torchtitan's MoE + ExpertParallel: router top-k, per-expert token counts exchanged with
`all_to_all_single`, the split sizes read back to the host (`.tolist()`), dispatch and combine with
`all_to_all_single_autograd`, and a permute by local expert around a grouped GEMM (`torch._grouped_mm`) of the
local experts (SwiGLU: w1, w3 up, w2 down). bf16 by default: torch._grouped_mm's meta impl takes bf16 only
(torch 2.13), and its CPU kernel wants rows of a multiple of 16 bytes (dims multiple of 8). Plain torch ops stand in for torchtitan's Triton permute kernel and
its per-expert padding.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


class TitanEpMoE(nn.Module):
    """One MoE layer whose `num_experts` experts are split evenly over the ranks of `group`; x: [T, dim]."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, group=None, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, route_norm: bool = False, route_scale: float = 1.0,
                 activation: str = "silu", fold_fp32: bool = False, leak: bool = False):
        """torchtitan's router options `route_norm` (top-k scores renormalised) and `route_scale`, and variations a
        pass must refuse: `activation="gelu"` (gelu(x @ w1) * (x @ w3)), `fold_fp32` (the fold multiplies and sums
        in float32, then casts), `leak` (the received token counts are also used after the block)."""
        super().__init__()
        self.route_norm, self.route_scale, self.activation = route_norm, route_scale, activation
        self.fold_fp32, self.leak = fold_fp32, leak
        self.group = group if group is not None else dist.group.WORLD
        self.ep_size = dist.get_world_size(self.group)
        self.ep_rank = dist.get_rank(self.group)
        assert num_experts % self.ep_size == 0
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local = num_experts // self.ep_size
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(dim, num_experts, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(num_experts, dim, generator=g) / dim**0.5)
        w1, w3 = (torch.randn(num_experts, hidden, dim, generator=g) / dim**0.5 for _ in range(2))
        w2 = torch.randn(num_experts, dim, hidden, generator=g) / hidden**0.5
        local = slice(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)
        w1, w3, w2 = (w.to(dtype) for w in (w1, w3, w2))
        self.router.to(dtype)
        self.w1, self.w3, self.w2 = (nn.Parameter(w[local].clone()) for w in (w1, w3, w2))
        self.full_weights = (w1, w3, w2)  # every expert, for the dense reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, dim = x.shape
        scores = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        top_scores, expert_ids = torch.topk(scores, self.top_k, dim=-1)
        if self.route_norm:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        if self.route_scale != 1.0:
            top_scores = top_scores * self.route_scale
        flat_ids = expert_ids.view(-1)
        # tokens per global expert; sorted by expert they are grouped by owner rank
        counts = torch.histc(flat_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()
        order = torch.argsort(flat_ids, stable=True)
        routed = x[order // self.top_k]
        # exchange the counts: recv_counts[r, e] = tokens rank r sends to local expert e of this rank
        recv_counts = funcol.all_to_all_single(counts, None, None, self.group)
        send_splits = counts.view(self.ep_size, self.num_local).sum(1)
        recv_splits = recv_counts.view(self.ep_size, self.num_local).sum(1)
        input_splits = send_splits.tolist()  # the host sync: data-dependent split sizes
        output_splits = recv_splits.tolist()
        received = funcol.all_to_all_single_autograd(routed, output_splits, input_splits, self.group)
        # permute (source rank, local expert) -> (local expert, source rank)
        local_ids = torch.arange(self.num_local, device=x.device).repeat(self.ep_size)
        local_ids = local_ids.repeat_interleave(recv_counts.view(-1), output_size=sum(output_splits))
        perm = torch.argsort(local_ids, stable=True)
        h = received[perm]
        offsets = torch.cumsum(recv_counts.view(self.ep_size, self.num_local).sum(0), 0, dtype=torch.int32)
        h1 = torch._grouped_mm(h, self.w1.transpose(-2, -1), offs=offsets)
        h3 = torch._grouped_mm(h, self.w3.transpose(-2, -1), offs=offsets)
        act = F.silu(h1) if self.activation == "silu" else F.gelu(h1)
        out = torch._grouped_mm(act * h3, self.w2.transpose(-2, -1), offs=offsets)
        # unpermute, send the results back, undo the sort and fold the top-k with the scores
        unpermuted = torch.empty_like(out)
        unpermuted[perm] = out
        returned = funcol.all_to_all_single_autograd(unpermuted, input_splits, output_splits, self.group)
        per_slot = torch.empty_like(returned)
        per_slot[order] = returned
        if self.fold_fp32:
            return (per_slot.view(T, self.top_k, dim).float() * top_scores.unsqueeze(-1)).sum(1).to(x.dtype)
        out = (per_slot.view(T, self.top_k, dim) * top_scores.unsqueeze(-1).to(x.dtype)).sum(1)
        return out + (recv_counts.sum() * 0).to(out.dtype) if self.leak else out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same layer with every expert local (no communication), in float64."""
        w1, w3, w2 = (w.double() for w in self.full_weights)
        x = x.double()
        scores = torch.softmax(x @ self.router.weight.double().t(), dim=-1)
        top_scores, expert_ids = torch.topk(scores, self.top_k, dim=-1)
        if self.route_norm:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        top_scores = top_scores * self.route_scale
        act = F.silu if self.activation == "silu" else F.gelu
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(self.top_k):
                e = expert_ids[t, j]
                y = (act(x[t] @ w1[e].t()) * (x[t] @ w3[e].t())) @ w2[e].t()
                out[t] += top_scores[t, j] * y
        return out


def hf_ep_model(impl: str, mesh, *, seed: int = 0, family: str = "qwen3_moe", **overrides):
    """The tiny Qwen3-MoE (or DeepSeek-V3) proxy (layer 0 dense, layer 1 sparse) with transformers' own expert parallelism
    (`ep_implementation=impl`: "all_reduce" or "all_to_all") on layer 1's experts over the 1-D `mesh` (EP group =
    TP group). transformers 5.17 has only the all-reduce form, as the config's `base_model_ep_plan` (EpRouterParallel
    + MoeExpertsParallel) applied by `apply_tensor_parallelism` with `enable_expert_parallel`; None where this
    transformers has neither."""
    from _dist import tiny_hf_model

    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError:
        try:
            from transformers.distributed import DistributedConfig
            from transformers.distributed.tensor_parallel import EpRouterParallel, apply_tensor_parallelism  # noqa: F401
        except ImportError:
            return None
        if impl != "all_reduce":
            return None
        model = tiny_hf_model(family, seed=seed, **overrides)
        model.config.distributed_config = DistributedConfig(enable_expert_parallel=True, tp_size=mesh.size())
        return apply_tensor_parallelism(model, mesh)

    model = tiny_hf_model(family, seed=seed, **overrides)
    prefix = "model.layers.1.mlp.experts"
    plan = {f"{prefix}.gate_up_proj": "grouped_gemm", f"{prefix}.down_proj": "grouped_gemm", prefix: "ep_dispatch_experts"}
    apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation=impl)
    return model


def hf_ep_moe_block(impl: str, mesh, *, seed: int = 0):
    """Layer 1's sparse MoE block of `hf_ep_model(impl, mesh)`, or None."""
    model = hf_ep_model(impl, mesh, seed=seed)
    return None if model is None else model.model.layers[1].mlp
