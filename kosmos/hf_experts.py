"""The HF transformers experts implementation "kosmos": runs the experts of a transformers v5 MoE model
(any experts class decorated with `@use_experts_implementation`) through `kosmos::moe_experts`.

This is the route for models whose Dynamo graph the MoE pass does not match (a custom router, an eager or
batched_mm experts implementation, ...): the router stays the model's own code, the experts become one kosmos
call per layer (one backward call), whatever the graph looks like:

    import kosmos                                 # registers "kosmos" with transformers' ExpertsInterface
    model.set_experts_implementation("kosmos")    # or from_pretrained(..., experts_implementation="kosmos")
    model = torch.compile(model, backend="kosmos")

Experts kosmos::moe_experts does not cover (biases, no gate, interleaved gate/up, a custom gate function, a
non-SiLU activation, a post-expert norm, expert parallelism) run HF's own `grouped_mm` implementation instead;
`unsupported_reason(experts_module)` says why.
"""
from __future__ import annotations

import logging

import torch

from kosmos.ops import moe as _moe_ops  # noqa: F401  (registers torch.ops.kosmos.moe_experts)

log = logging.getLogger("kosmos")

NAME = "kosmos"
_SILU_CLASSES = ("SiLU", "SiLUActivation")
_hf_moe_module = None


def _hf_moe():
    """transformers.integrations.moe, imported outside the forward Dynamo traces: torch 2.11's Dynamo cannot
    import from transformers' lazy `integrations` package inside a traced function ("Bad import result")."""
    global _hf_moe_module
    if _hf_moe_module is None:
        import transformers.integrations.moe as hf_moe

        _hf_moe_module = hf_moe
    return _hf_moe_module


def unsupported_reason(experts) -> str | None:
    """Why kosmos::moe_experts cannot run this HF experts module, or None when it can."""
    hf_moe = _hf_moe()
    if getattr(experts, "_is_expert_parallel", False):
        return "expert parallelism (HF's EP sentinels) is not supported yet"
    if getattr(experts, "has_bias", False):
        return "experts with biases"
    if not getattr(experts, "has_gate", True):
        return "experts without a gate (no gate_up_proj)"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up layout"
    if getattr(experts, "has_post_expert_norm", False):
        return "post-expert norm"
    if getattr(type(experts), "_apply_gate", hf_moe._default_apply_gate) is not hf_moe._default_apply_gate:
        return f"custom gate function {type(experts).__name__}._apply_gate"
    act = getattr(experts, "act_fn", None)
    if type(act).__name__ not in _SILU_CLASSES:
        return f"activation {type(act).__name__} (only SiLU)"
    return None


def kosmos_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts forward signature: hidden [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H]."""
    reason = unsupported_reason(self)
    if reason is not None:
        if not torch.compiler.is_compiling():
            log.info("experts_implementation=%r: %s; running HF's grouped_mm experts", NAME, reason)
        return _hf_moe().grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = self.gate_up_proj, self.down_proj
    if getattr(self, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    out, _ = torch.ops.kosmos.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down)
    return out


def register() -> bool:
    """Registers "kosmos" with transformers' ExpertsInterface (idempotent); False when transformers is missing."""
    try:
        hf_moe = _hf_moe()
    except ImportError:
        return False
    hf_moe.ExpertsInterface.register(NAME, kosmos_experts_forward)
    return True
