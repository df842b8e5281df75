"""Plugs the fused MoE kernels into `kosmos::moe_layer` (forward: kosmos.kernels.moe) and
`kosmos::moe_layer_backward` (backward: kosmos.kernels.moe_backward) through kosmos.ops.dispatch.

Env KOSMOS_FUSED_MOE (read at each call) picks the directions that run fused: unset (the default: the forward,
except for an fp32 router on 16-bit hidden states), "forward", "1" both, "0" neither. Both kernels pass their GPU
tests on an H200. On the benchmark cells (benchmarks/RESULTS.md, fifth session, T=16384) the fused backward is
about 8x slower than the op's reference impl (grouped matmuls on the saved up projection), so it is opt-in; the fused
forward is faster than the reference on Qwen3-30B-A3B (2.89 vs 3.36 ms) and Qwen3-235B (9.99 vs 10.13), slower
on DeepSeek-V3 (30.75 vs 28.26; fwd+bwd 96.5 vs 86.0), whose fp32 router the kernel computes exactly on CUDA
cores: so by default an fp32 router on 16-bit hidden states takes the reference (FP32_ROUTER_REASON).
`why_not_*` also refuses, with the reason:
- non-CUDA tensors, GPUs before sm_90 (TMA descriptors);
- expert parallelism (ep_group_name set) on a real process group: the EP kernels (kosmos.kernels.moe_ep,
  moe_ep_backward) pass their tests in SimWorld only and are not wired to real groups until they have run on
  several GPUs;
- n_group not a power of two (group-limited routing), activations other than silu;
- dtypes other than bfloat16 / float16 / float32; gate_up_proj and down_proj of different dtypes; a product
  dtype promote(down_proj, logits) that is neither float32 nor down_proj's dtype;
- more than 256 experts or top_k > 16 (the router tile holds all experts of BT tokens in registers);
- T == 0; non-contiguous expert weights, hidden / router_weight rows without unit stride, TMA alignment
  (16-byte aligned bases, H and I rows of a multiple of 16 bytes).
The backward (`why_not_moe_layer_backward`) refuses the same, plus grad_out / grad_router_logits of other
shapes or dtypes (kosmos.kernels.moe_backward.backward_reason, mirrored here without importing Triton).
This module imports no Triton (the kernel is imported at the first fused call).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from kosmos.ops import dispatch

ENV = "KOSMOS_FUSED_MOE"
MAX_EXPERTS = 256
MAX_TOP_K = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_MODES = {"forward": ("forward",), "1": ("forward", "backward"), "0": ()}
FP32_ROUTER_REASON = (f"fp32 router on 16-bit hidden states: the fused forward is slower than this reference impl "
                      f"there on an H200 (DeepSeek-V3 layer, benchmarks/RESULTS.md); {ENV}=forward forces it")


def enabled(direction: str) -> bool:
    """Whether `direction` ("forward" / "backward") may run fused under env KOSMOS_FUSED_MOE."""
    mode = os.environ.get(ENV, "forward")
    if mode not in _MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {sorted(_MODES)}")
    return direction in _MODES[mode]


def _default_forward_reason(hidden, router_dtype) -> Optional[str]:
    """Where the default (env unset) leaves the forward to the reference because it measured faster."""
    if ENV in os.environ:
        return None
    if router_dtype == torch.float32 and hidden.dtype != torch.float32:
        return FP32_ROUTER_REASON
    return None


def kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  n_group, topk_group, router_dtype, activation) -> Optional[str]:
    """Why the kernel cannot take these arguments (device-independent part), or None."""
    if scoring not in ("softmax", "sigmoid"):
        return f"router scoring={scoring!r}: the fused kernel supports softmax and sigmoid"
    if n_group & (n_group - 1):
        return f"n_group={n_group}: the fused kernel's group-limited routing needs a power of two"
    if score_correction_bias is not None and score_correction_bias.dtype not in _DTYPES:
        return f"score_correction_bias dtype {score_correction_bias.dtype}"
    if score_correction_bias is not None and score_correction_bias.stride(0) != 1 and score_correction_bias.numel() > 1:
        return "score_correction_bias is not contiguous"
    if activation != "silu":
        return f"activation {activation!r}: the fused kernel supports silu (SwiGLU) only"
    rd = router_dtype or hidden.dtype
    for name, t in (("hidden", hidden), ("router_weight", router_weight), ("gate_up_proj", gate_up_proj),
                    ("down_proj", down_proj)):
        if t.dtype not in _DTYPES:
            return f"{name} dtype {t.dtype}: the fused kernel takes bfloat16/float16/float32"
    if rd not in _DTYPES:
        return f"router_dtype {rd}: the fused kernel takes bfloat16/float16/float32"
    if router_bias is not None and router_bias.dtype not in _DTYPES:
        return f"router_bias dtype {router_bias.dtype}"
    if gate_up_proj.dtype != down_proj.dtype:
        return f"gate_up_proj {gate_up_proj.dtype} and down_proj {down_proj.dtype} differ"
    product = torch.promote_types(down_proj.dtype, rd)
    if product not in (torch.float32, down_proj.dtype):
        return f"product dtype {product} of down_proj {down_proj.dtype} and logits {rd}"
    T, H = hidden.shape
    E, two_i, _ = gate_up_proj.shape
    I = two_i // 2
    if T == 0:
        return "no tokens (T == 0)"
    if E > MAX_EXPERTS:
        return f"{E} experts > {MAX_EXPERTS} (the router tile holds every expert's logit in registers)"
    if top_k > MAX_TOP_K:
        return f"top_k={top_k} > {MAX_TOP_K}"
    if hidden.stride(1) != 1 and H > 1:
        return f"hidden strides {tuple(hidden.stride())}: rows need unit stride"
    if router_weight.stride(1) != 1 and H > 1:
        return f"router_weight strides {tuple(router_weight.stride())}: rows need unit stride"
    if router_bias is not None and router_bias.stride(0) != 1 and E > 1:
        return "router_bias is not contiguous"
    from kosmos.kernels.fused_ops import _misaligned  # (fused_ops imports this module)

    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if not t.is_contiguous():
            return f"{name} is not contiguous (TMA descriptors over [E*rows, cols])"
        if _misaligned(t):
            return f"{name} base address is not 16-byte aligned (TMA)"
    size = gate_up_proj.element_size()
    if (H * size) % 16:
        return f"H={H}: gate_up_proj rows of {H * size} bytes are not a multiple of 16 (TMA)"
    if (I * down_proj.element_size()) % 16:
        return (f"I={I}: down_proj / activation rows of {I * down_proj.element_size()} bytes are not a multiple of 16 "
                "(TMA)")
    return None


def _device_reason(hidden, ep_group_name, ep_mode) -> Optional[str]:
    if hidden.device.type != "cuda":
        return f"{hidden.device.type} tensors"
    if torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return "TMA descriptors need compute capability >= 9.0"
    if ep_group_name is not None:
        return (f"expert parallelism (ep_group_name={ep_group_name!r}, ep_mode={ep_mode!r}): the EP kernels run in "
                "SimWorld only until they have run on several GPUs")
    return None


def why_not_moe_layer(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                      scoring, norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                      activation="silu", return_router_logits=False, ep_group_name=None, ep_world_size=1,
                      ep_mode="all_to_all") -> Optional[str]:
    if not enabled("forward"):
        return f"fused MoE forward switched off ({ENV}={os.environ.get(ENV)})"
    reason = _device_reason(hidden, ep_group_name, ep_mode) or _default_forward_reason(hidden, router_dtype)
    if reason is not None:
        return reason
    return kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                         scoring, n_group, topk_group, router_dtype, activation)


def run_moe_layer(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                  activation="silu", return_router_logits=False, ep_group_name=None, ep_world_size=1,
                  ep_mode="all_to_all"):
    from kosmos.kernels.moe import moe_forward

    return moe_forward(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                       scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, activation,
                       return_router_logits, save_up=True)


def _backward_reason(grad_out, grad_router_logits, hidden, E: int) -> Optional[str]:
    """kosmos.kernels.moe_backward.backward_reason without importing Triton (E: the router's experts)."""
    T, H = hidden.shape
    if tuple(grad_out.shape) != (T, H):
        return f"grad_out {tuple(grad_out.shape)} is not [T={T}, H={H}]"
    if grad_out.dtype not in _DTYPES:
        return f"grad_out dtype {grad_out.dtype}"
    if grad_router_logits is not None:
        if tuple(grad_router_logits.shape) != (T, E):
            return f"grad_router_logits {tuple(grad_router_logits.shape)} is not [T={T}, E={E}]"
        if grad_router_logits.dtype not in _DTYPES:
            return f"grad_router_logits dtype {grad_router_logits.dtype}"
    return None


def why_not_moe_layer_backward(grad_out, grad_router_logits, hidden, router_weight, router_bias,
                               score_correction_bias, gate_up_proj, down_proj, top_k, scoring, norm_topk_prob,
                               n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                               activation="silu", ep_group_name=None, ep_world_size=1,
                               ep_mode="all_to_all", saved_up=None) -> Optional[str]:
    if not enabled("backward"):
        return (f"fused MoE backward is opt-in ({ENV}=1): slower than this reference impl on an H200 "
                "(benchmarks/RESULTS.md)")
    reason = _device_reason(hidden, ep_group_name, ep_mode)
    if reason is not None:
        return reason
    return (kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                          scoring, n_group, topk_group, router_dtype, activation)
            or _backward_reason(grad_out, grad_router_logits, hidden, gate_up_proj.shape[0]))


def run_moe_layer_backward(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                           gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, router_dtype=None, activation="silu", ep_group_name=None,
                           ep_world_size=1, ep_mode="all_to_all", saved_up=None):
    """saved_up is not read: the fused backward recomputes the up projection in its own tiles."""
    from kosmos.kernels.moe_backward import moe_backward

    return moe_backward(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                        gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group,
                        routed_scaling_factor, router_dtype, activation)


def register() -> None:
    from kosmos.kernels import moe_rows

    dispatch.register_fused("moe_layer", why_not_moe_layer, run_moe_layer)
    dispatch.register_fused("moe_layer_backward", why_not_moe_layer_backward, run_moe_layer_backward)
    dispatch.register_row_kernel("moe_scaled_act", moe_rows.scaled_act)
    dispatch.register_row_kernel("moe_swiglu_rows_backward", moe_rows.swiglu_rows_backward)
    dispatch.register_row_kernel("moe_fold", moe_rows.fold)
