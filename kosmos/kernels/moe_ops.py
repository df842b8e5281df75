"""Plugs the fused MoE kernels into `kosmos::moe_layer` (forward: kosmos.kernels.moe, with expert parallelism
kosmos.kernels.moe_ep) and `kosmos::moe_layer_backward` (backward: kosmos.kernels.moe_backward / moe_ep_backward)
through kosmos.ops.dispatch.

Env KOSMOS_FUSED_MOE (read at each call) picks the directions that run fused: unset (the default: the forward,
except for experts whose grouped matmuls run kosmos's grouped GEMM, where the reference forward is faster since
its SwiGLU is one row kernel: `_reference_experts_reason`, thirty-eighth session), "forward" (the forward
everywhere), "1" both, "0" neither. Both kernels pass their GPU
tests on an H200. On the benchmark cells (benchmarks/RESULTS.md, fifth session, T=16384) the fused backward is
about 8x slower than the op's reference impl (grouped matmuls on the saved up projection), so it is opt-in; the fused
forward was faster than the reference on Qwen3-30B-A3B (2.89 vs 3.36 ms) and Qwen3-235B (9.99 vs 10.13; no longer
once the reference's grouped GEMMs and SwiGLU got their own kernels, thirty-eighth session), and since
its fp32 router runs tf32x3 (eighth session) on DeepSeek-V3 too: 28.43 vs 30.25 ms forward, 89.70 vs 89.57 ms
forward + backward (10+ timed calls each; the earlier "slower training step" figures were single calls of
triton's do_bench, RESULTS.md eighth session). Under expert parallelism an fp32 router on 16-bit hidden states
still takes the reference forward by default (FP32_ROUTER_REASON: not measured since the tf32x3 router); the env
and the other defaults hold with expert parallelism too. On 2 H200s (benchmarks/RESULTS.md, sixth session) the fused
EP forward is 1.28-1.57x faster than the unfused all_to_all path, and the fused EP backward 2-3x slower than the EP
reference backward (recomputed up projection, all_to_all_single), so the EP backward stays opt-in too.
`why_not_*` also refuses, with the reason:
- non-CUDA tensors, GPUs before sm_90 (TMA descriptors);
- expert parallelism (ep_group_name set): ep_mode "all_reduce" (the kernels implement the all_to_all layout), a
  group that is not NCCL or not of ep_world_size ranks, CUDA graph capture (the check below reads the host), more
  than 256 experts in all; and, decided by the whole group at each call (`_agree`: one all_reduce of three ints
  and a host read), any rank whose arguments the kernel refuses or ranks holding different token counts T (the
  receive regions are sized by one T). Every rank of the group therefore takes the same impl: the two impls'
  collectives never meet. On fake tensors (the MoE pass's planned impl) only this rank's arguments are judged.
  The group's rank runs the EP kernel on runtime.group_workspace (kosmos.kernels.moe_ep_group);
- n_group not a power of two (group-limited routing), activations other than silu;
- dtypes other than bfloat16 / float16 / float32; gate_up_proj and down_proj of different dtypes; a product
  dtype promote(down_proj, logits) that is neither float32 nor down_proj's dtype;
- more than 256 experts or top_k > 16 (the router tile holds all experts of BT tokens in registers);
- T == 0; non-contiguous expert weights, hidden / router_weight rows without unit stride, TMA alignment
  (16-byte aligned bases, H and I rows of a multiple of 16 bytes).
The backward (`why_not_moe_layer_backward`) refuses the same, plus grad_out / grad_router_logits of other
shapes or dtypes (kosmos.kernels.moe_backward.backward_reason, mirrored here without importing Triton).
Every rank of an EP group must see the same KOSMOS_FUSED_MOE. This module imports no Triton (the kernel is
imported at the first fused call).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from kosmos.kernels import launch_plan, runtime
from kosmos.ops import dispatch
from kosmos.ops.moe import no_saved_up
from kosmos.reporting import record_run

ENV = "KOSMOS_FUSED_MOE"
MAX_EXPERTS = 256
MAX_TOP_K = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_MODES = {"forward": ("forward",), "1": ("forward", "backward"), "0": ()}
FP32_ROUTER_REASON = (f"fp32 router on 16-bit hidden states under expert parallelism: the fused EP forward with this "
                      f"router has not been timed against this reference impl (without EP it is faster since its "
                      f"router runs tf32x3); {ENV}=forward forces it")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """os.environ[name] (default where unset), which must be one of choices: a kosmos switch read at each call."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    return value


@contextlib.contextmanager
def env_var(name: str, value: Optional[str]):
    """os.environ[name] = value inside the block (None: unset); restored after it."""
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def fused_env(value: Optional[str]):
    """KOSMOS_FUSED_MOE = value inside the block (None: unset, the defaults); restored after it."""
    return env_var(ENV, value)


def enabled(direction: str) -> bool:
    """Whether `direction` ("forward" / "backward") may run fused under env KOSMOS_FUSED_MOE."""
    return direction in _MODES[env_choice(ENV, tuple(_MODES), "forward")]


def router_precision(rd: torch.dtype, hidden_dtype: Optional[torch.dtype]) -> str:
    """The fused kernels' router-GEMM tl.dot precision (a 16-bit router ignores it). An fp32 router on 16-bit hidden
    states without allow_tf32 (DeepSeek-V3's) runs "tf32x3" on the tensor cores, not exact fp32 FMA (10 TF/s there:
    6.2 of the DeepSeek-V3 layer's 28.5 ms on the H200, benchmarks/moe_trace.py). The forward's router GEMM
    (moe_route.router_logits) skips the split term that is zero: the hidden value is exact in TF32, the weight is
    split into two TF32 parts (within 2**-22 of it), two tensor-core dots per K block, each block's sum added in fp32;
    the backward's router dots (fp32 gradients) run tl.dot's three. A GPU test holds the logits as close to the fp64
    product as cuBLAS's exact fp32 GEMM's. With allow_tf32, TF32 (torch's rule)."""
    if rd != torch.float32 or torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "tf32x3" if hidden_dtype in (torch.bfloat16, torch.float16) else "ieee"


def router_split(rd: torch.dtype, hidden_dtype: torch.dtype) -> bool:
    """Whether the fused forward without EP runs its "tf32x3" router (router_precision) as three bf16 dots of the
    weight pre-split into bf16 parts (moe.split_router_weight), in RGEMM tasks (MoeConfig.router_gemm): bf16 hidden
    states only (an fp16 value is not exact in bf16)."""
    return hidden_dtype == torch.bfloat16 and router_precision(rd, hidden_dtype) == "tf32x3"


def _router_note(hidden, router_dtype) -> Optional[str]:
    if router_precision(router_dtype or hidden.dtype, hidden.dtype) == "tf32x3":
        return "router GEMM in 3xTF32 (fp32 router on 16-bit hidden states, allow_tf32 off: fp32-accurate)"
    return None


def _layer_note(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None, *rest, **kw):
    ep_group_name = rest[2] if len(rest) > 2 else kw.get("ep_group_name")
    if ep_group_name is None and router_split(router_dtype or hidden.dtype, hidden.dtype):
        return ("router GEMM as three bf16 dots of the fp32 weight split in bf16 parts (fp32 router on bf16 hidden "
                "states, allow_tf32 off: fp32-accurate)")
    return _router_note(hidden, router_dtype)


def _layer_backward_note(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                         gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, router_dtype=None, *rest, **kw):
    return _router_note(hidden, router_dtype)


def _default_forward_reason(hidden, router_dtype, ep_group_name, gate_up_proj, top_k) -> Optional[str]:
    """Where the default (env unset) leaves the forward to the reference: experts whose grouped matmuls run kosmos's
    grouped GEMM (`_reference_experts_reason`) without EP; an fp32 router on 16-bit hidden states under expert
    parallelism (without EP the fused forward measured faster, RESULTS.md eighth session)."""
    if ENV in os.environ:
        return None
    if ep_group_name is None:
        return _reference_experts_reason(hidden, gate_up_proj, top_k)
    if router_dtype == torch.float32 and hidden.dtype != torch.float32:
        return FP32_ROUTER_REASON
    return None


# The reference forward was measured against the fused one on layers of 128 and 256 experts; Mixtral's 8 experts of
# 117M elements (which the fused forward claims in groups of row blocks, MoeConfig.group_blocks) were not.
REFERENCE_MIN_EXPERTS = 64


def _reference_experts_reason(hidden, gate_up_proj, top_k) -> Optional[str]:
    """The reason for the reference forward where its up projection takes kosmos's grouped GEMM (grouped_rows_mm's
    auto rule: per-expert weights of WIDE_EXPERT elements, or CLAIMED_EXPERT with claimed tiles), else None. There
    the reference (split grouped GEMMs, the SwiGLU row kernel, the fold) beat the fused forward on every cell
    measured: Qwen3-235B fwd 8.67 / 4.44 / 2.58 ms against 8.96 / 5.01 / 2.89 at T = 16384 / 8192 / 4096 and fwd+bwd
    26.97 / 15.13 against 27.84 / 15.62 (9.20 / 9.16 at 4096), DeepSeek-V3 fwd 25.43 / 14.00 / 8.95 against 26.06 /
    14.45 / 9.14 and fwd+bwd 76.60 / 44.46 / 28.79 against 77.69 / 44.92 / 29.36 (RESULTS.md, thirty-eighth session).
    Qwen3-30B-A3B's experts stay on torch's grouped kernel and on the fused forward (within 4% either way there, and
    its host-bound T = 4096 fwd+bwd is 0.8 ms slower on the reference); so do layers of fewer than
    REFERENCE_MIN_EXPERTS experts (not measured)."""
    from kosmos.kernels import gemm_ws_host

    if os.environ.get("KOSMOS_GROUPED_MM", "auto") == "torch" or gate_up_proj.dtype not in (torch.bfloat16,
                                                                                             torch.float16):
        return None
    E, two_i, H = gate_up_proj.shape
    if H % 8 or two_i % 16:  # rows of 16 bytes for the TMA (gemm_ws_host.grouped_unsupported)
        return None
    if E < REFERENCE_MIN_EXPERTS:
        return None
    claimed, least = _grouped_auto_size(hidden.shape[0] * top_k + E, E)
    if two_i * H < least or gemm_ws_host.cannot_run_here(hidden) is not None:
        return None
    return (f"the reference forward: its expert matmuls ({two_i} x {H} per expert) take kosmos's grouped GEMM"
            f"{' with claimed tiles' if claimed else ''}, and with its SwiGLU row kernel it is faster than the fused "
            f"forward there (RESULTS.md, thirty-eighth session); {ENV}=forward forces the fused one")


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


def _device_reason(hidden) -> Optional[str]:
    if hidden.device.type != "cuda":
        return f"{hidden.device.type} tensors"
    if torch.cuda.get_device_capability(hidden.device)[0] < 9:
        return "TMA descriptors need compute capability >= 9.0"
    return None


def _ep_group_reason(group_name: str, world: int, ep_mode: str, num_local: int,
                     device: torch.device) -> Optional[str]:
    """Why no rank of the EP group can run fused: what every rank of the group judges alike (op arguments of the
    group's common call, the group itself)."""
    if ep_mode != "all_to_all":
        return (f"ep_mode={ep_mode!r} (replicated tokens, outputs summed over the group): the fused EP kernels "
                "implement the all_to_all layout")
    if num_local * world > MAX_EXPERTS:
        return f"{num_local * world} experts > {MAX_EXPERTS} (the router tile holds every expert's logit in registers)"
    from kosmos.kernels.fused_ops import _group_reason  # (fused_ops imports this module)

    reason = _group_reason(group_name, world)
    if reason is not None:
        return reason
    from kosmos.kernels.runtime import capturing

    if capturing(device):
        return ("CUDA graph capture: the fused EP path checks every rank's token count with a host read at each "
                "call")
    return None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _agree(group_name: str, hidden: torch.Tensor, local: Optional[str]) -> Optional[str]:
    """The group's verdict, the same on every rank: this rank's reason if it has one, else a reason when another
    rank refused or the ranks' token counts differ, else None. Collective (every rank of the group must call it):
    one all_reduce (max) of [refused, T, -T] and a host read."""
    T = hidden.shape[0]
    mine = torch.tensor([int(local is not None), T, -T], dtype=torch.int64, device=hidden.device)
    fc = torch.ops._c10d_functional
    refused, t_max, neg_t_min = fc.wait_tensor(fc.all_reduce(mine, "max", group_name)).tolist()
    if local is not None:
        return local
    if refused:
        return f"another rank of EP group {group_name!r} refused the fused kernel (its report says why)"
    if t_max != -neg_t_min:
        return (f"the ranks of EP group {group_name!r} hold different token counts (T from {-neg_t_min} to {t_max}, "
                f"here {T}): the fused EP kernel sizes its receive regions by one T")
    return None


def _ep_reason(hidden, gate_up_proj, group_name, world, ep_mode, local_reason) -> Optional[str]:
    """Why an EP call takes the reference impl, decided alike on every rank of the group (module docstring);
    local_reason() -> this rank's own reason (arguments the kernel refuses)."""
    reason = _ep_group_reason(group_name, world, ep_mode, gate_up_proj.shape[0], hidden.device)
    if reason is not None:
        return reason
    if _is_fake(hidden):  # judged at compile time (the pass's planned impl): no collective there
        return local_reason()
    return _agree(group_name, hidden, local_reason())


def _weights_reason(hidden, router_dtype, weights_dtype, keeps_fp32: bool) -> Optional[str]:
    """Routing weights in another dtype than the logits' (Mixtral's fp32 weights): the fused forward kernels keep
    fp32 weights (keeps_fp32); the fused backward kernels round the weights to the logits' dtype."""
    rd = router_dtype or hidden.dtype
    if weights_dtype is None or weights_dtype == rd or (keeps_fp32 and weights_dtype == torch.float32):
        return None
    which = ("the fused kernels keep fp32 or logits-dtype weights" if keeps_fp32 else
             "the fused backward rounds the weights to the logits' dtype (the fused forward keeps fp32)")
    return f"routing weights kept in {weights_dtype} (Mixtral's router) with {rd} logits: {which}"


def why_not_moe_layer(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                      scoring, norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                      activation="silu", return_router_logits=False, ep_group_name=None, ep_world_size=1,
                      ep_mode="all_to_all", save_up=True, weights_dtype=None) -> Optional[str]:
    if not enabled("forward"):
        return f"fused MoE forward switched off ({ENV}={os.environ.get(ENV)})"
    # weights_dtype is a graph constant: the same reason on every EP rank
    reason = _weights_reason(hidden, router_dtype, weights_dtype, keeps_fp32=True)
    if reason is not None:
        return reason
    reason = _device_reason(hidden) or _default_forward_reason(hidden, router_dtype, ep_group_name, gate_up_proj,
                                                                 top_k)
    if reason is not None:
        return reason

    def local():
        return kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k,
                             scoring, n_group, topk_group, router_dtype, activation)

    if ep_group_name is None:
        return local()
    return _ep_reason(hidden, gate_up_proj, ep_group_name, ep_world_size, ep_mode, local)


def run_moe_layer(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
                  norm_topk_prob, n_group=1, topk_group=1, routed_scaling_factor=1.0, router_dtype=None,
                  activation="silu", return_router_logits=False, ep_group_name=None, ep_world_size=1,
                  ep_mode="all_to_all", save_up=True, weights_dtype=None):
    if ep_group_name is not None:  # saved_up is empty under EP: the backward recomputes the up projection
        from kosmos.kernels.moe_ep_group import moe_ep_forward_group

        out, logits, counts = moe_ep_forward_group(hidden, router_weight, router_bias, score_correction_bias,
                                                   gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group,
                                                   topk_group, routed_scaling_factor, router_dtype, activation,
                                                   return_router_logits, ep_group_name, weights_dtype=weights_dtype)
        return (out, logits, counts, no_saved_up(gate_up_proj),
                counts.new_empty(0, top_k, dtype=torch.int32))
    from kosmos.kernels.moe import moe_forward

    out, logits, counts, *saved_up, ids, _ = moe_forward(
        hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj, top_k, scoring,
        norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, activation,
        return_router_logits=True, save_up=save_up, return_routing=True,  # the logits: for the backward
        weights_dtype=weights_dtype)
    return out, logits, counts, saved_up[0] if save_up else no_saved_up(gate_up_proj), ids


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
                               ep_mode="all_to_all", weights_dtype=None, saved_up=None, topk_ids=None,
                               router_logits=None) -> Optional[str]:
    if not enabled("backward"):
        return (f"fused MoE backward is opt-in ({ENV}=1): slower than this reference impl on an H200 "
                "(benchmarks/RESULTS.md)")
    reason = _weights_reason(hidden, router_dtype, weights_dtype, keeps_fp32=False)
    if reason is not None:
        return reason
    reason = _device_reason(hidden)
    if reason is not None:
        return reason

    def local():
        return (kernel_reason(hidden, router_weight, router_bias, score_correction_bias, gate_up_proj, down_proj,
                              top_k, scoring, n_group, topk_group, router_dtype, activation)
                or _backward_reason(grad_out, grad_router_logits, hidden, gate_up_proj.shape[0] * ep_world_size))

    if ep_group_name is None:
        return local()
    return _ep_reason(hidden, gate_up_proj, ep_group_name, ep_world_size, ep_mode, local)


def run_moe_layer_backward(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                           gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group=1, topk_group=1,
                           routed_scaling_factor=1.0, router_dtype=None, activation="silu", ep_group_name=None,
                           ep_world_size=1, ep_mode="all_to_all", weights_dtype=None, saved_up=None, topk_ids=None,
                           router_logits=None):
    """saved_up, topk_ids and router_logits are not read: the fused backward routes again in its own kernel (the
    same tiles and bits as the fused forward's routing) and recomputes the up projection in its own tiles."""
    if ep_group_name is not None:
        from kosmos.kernels.moe_ep_group import moe_ep_backward_group

        return moe_ep_backward_group(grad_out, grad_router_logits, hidden, router_weight, router_bias,
                                     score_correction_bias, gate_up_proj, down_proj, top_k, scoring, norm_topk_prob,
                                     n_group, topk_group, routed_scaling_factor, router_dtype, activation,
                                     ep_group_name)
    from kosmos.kernels.moe_backward import moe_backward

    return moe_backward(grad_out, grad_router_logits, hidden, router_weight, router_bias, score_correction_bias,
                        gate_up_proj, down_proj, top_k, scoring, norm_topk_prob, n_group, topk_group,
                        routed_scaling_factor, router_dtype, activation)


# Per-expert weights of at least this many elements take kosmos's ragged-M grouped matmuls by default, with m-fastest
# tiles (the weight gradients: WGRAD_MIN_ELEMENTS). Measured on the H200 (RESULTS.md, thirtieth and thirty-first
# sessions): DeepSeek-V3's layer (4096 x 7168 and 7168 x 2048 per expert) is faster fwd+bwd at T = 4096 and no slower
# at 16384; on Qwen3-235B's (at most 3072 x 4096) torch's CUTLASS kernels are as fast or faster in the static tile
# order.
WIDE_EXPERT = 14_000_000
# With claimed tiles (gemm_ws_host.grouped_claim) the ragged-M ones take kosmos's kernel from this size: Qwen3-235B's
# (6.3M and 12.6M elements) ran its layer's fwd+bwd 2.7-7% faster at T = 4096 to 16384 (RESULTS.md, thirty-seventh
# session); Qwen3-30B-A3B's (at most 3.1M) are faster on torch's kernel.
CLAIMED_EXPERT = 6_000_000
# The weight gradients (ragged K) take kosmos's kernel on auto from this many elements per expert: every size. In the
# layer, kosmos's kernel ran the Qwen3 cells' fwd+bwd 1-4% faster than torch's CUTLASS one at T = 4096 to 16384 on
# an H100 (RESULTS.md, sixty-eighth session; earlier H200 A/Bs: Qwen3-235B 1.3% faster at 4096, tied at 16384), the
# same bits either way. DeepSeek-V3's (14.7M and 29.4M elements) took it before.
WGRAD_MIN_ELEMENTS = 0


def _kosmos_mode(env: str, modes: tuple[str, ...], unsupported, shape: tuple[int, int], what: str, every_size: str,
                 min_elements: int = WIDE_EXPERT) -> tuple[Optional[str], Optional[str]]:
    """(env's mode, None) when kosmos's kernel runs, else (None, the reason torch._grouped_mm runs). env's modes:
    "auto", the default, takes kosmos's kernel for per-expert matrices `shape` of min_elements or more; "torch"
    never. unsupported(): why the kernel cannot take the operands, or None."""
    mode = env_choice(env, modes, "auto")
    reason = f"{env}=torch" if mode == "torch" else unsupported()
    if reason is None and mode == "auto" and shape[0] * shape[1] < min_elements:
        reason = (f"a {shape[0]} x {shape[1]} {what} per expert, where torch's kernel is as fast (kosmos's from "
                  f"{min_elements} elements here; {env}={every_size} for every size)")
    return (None, reason) if reason is not None else (mode, None)


# (op, the operands' tensor keys, row and group counts, the switches' values) -> (kosmos's choice or None, the
# reason torch._grouped_mm runs): the grouped matmuls' choices, made on a signature's first call (their checks are
# 20-35 us of host time a call, four calls a Qwen3-30B-A3B backward step; RESULTS.md fifty-ninth session)
_choices = launch_plan.PlanCache()


def _kept_choice(key: tuple, decide) -> tuple:
    key = key + (runtime.interpreting(),)
    kept = _choices.get(key)
    if kept is None:
        kept = decide()
        _choices.put(key, kept)
    return kept


def _grouped_auto_size(rows: int, groups: int) -> tuple[bool, int]:
    """(whether the ragged-M grouped matmuls over `rows` rows in `groups` groups claim their tiles, the per-expert
    weight size in elements from which KOSMOS_GROUPED_MM=auto takes kosmos's kernel for them)."""
    from kosmos.kernels import gemm_ws_host

    claimed = gemm_ws_host.grouped_claim(rows, groups)
    return claimed, CLAIMED_EXPERT if claimed else WIDE_EXPERT


def _grouped_choice(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, record: bool = True,
                    rows: Optional[int] = None) -> Optional[tuple[bool, bool, str]]:
    """(m_fastest, claim, config) of kosmos's ragged-M grouped GEMM for these operands by KOSMOS_GROUPED_MM /
    KOSMOS_GROUPED_CONFIG (grouped_rows_mm's docstring), or None where torch._grouped_mm runs (recorded if
    `record`). rows: A's row count where a is the source its rows are gathered from (default a's)."""
    key = ("grouped_mm", launch_plan.tensor_key(a), launch_plan.tensor_key(b), ends.numel(), rows,
           os.environ.get("KOSMOS_GROUPED_MM"), os.environ.get("KOSMOS_GROUPED_CONFIG"))
    choice, reason = _kept_choice(key, lambda: _decide_grouped(a, b, ends, rows))
    if reason is not None and record:
        record_run("grouped_mm", "torch._grouped_mm", reason)
    return choice


def _decide_grouped(a, b, ends, rows) -> tuple:
    """_grouped_choice's (choice, reason) without the memo."""
    from kosmos.kernels import gemm_ws_host

    claimed, least = _grouped_auto_size(a.shape[0] if rows is None else rows, ends.numel())
    mode, reason = _kosmos_mode("KOSMOS_GROUPED_MM", ("auto", "kosmos", "kosmos_m", "kosmos_mc", "torch"),
                                lambda: gemm_ws_host.grouped_unsupported(a, b), b.shape[1:], "weight", "kosmos_m",
                                least)
    if mode is None:
        return None, reason
    claim = mode == "kosmos_mc" or (mode == "auto" and claimed)
    config = os.environ.get("KOSMOS_GROUPED_CONFIG") or gemm_ws_host.grouped_config(claim)
    if config not in gemm_ws_host.GROUPED_CONFIGS:
        raise ValueError(f"KOSMOS_GROUPED_CONFIG={config!r}: expected one of {sorted(gemm_ws_host.GROUPED_CONFIGS)}")
    return (mode != "kosmos", claim, config), None


def _grouped_impl(m_fastest: bool, claim: bool, config: str) -> str:
    return f"kosmos grouped_ws{' m-fastest' if m_fastest else ''}{' claimed' if claim else ''} {config}"


def grouped_rows_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> Optional[torch.Tensor]:
    """The reference's ragged-M grouped matmul by kosmos's grouped GEMM (gemm_ws_host.grouped_mm) when it takes the
    operands and pays off, else None (the caller runs torch._grouped_mm). KOSMOS_GROUPED_MM: auto (default: weights
    of WIDE_EXPERT elements or more per expert, with a group's m-tiles next to each other, so an expert's weight is
    read once for all its rows while it is in L2, and from gemm_ws_host.CLAIM_MIN_ROWS rows per expert the tiles
    claimed from a counter, so the ones sharing a weight block run together, and then from CLAIMED_EXPERT
    elements), kosmos_m (m-fastest, not claimed, for every size), kosmos_mc (m-fastest and claimed for every size),
    kosmos (a group's column blocks next to each other), torch (never); KOSMOS_GROUPED_CONFIG: the
    gemm_ws_host.GROUPED_CONFIGS entry (default: split consumers with claimed tiles, gemm_ws_host.grouped_config).
    The report records which ran and why; the bits are the same."""
    from kosmos.kernels import gemm_ws_host

    choice = _grouped_choice(a, b, ends)
    if choice is None:
        return None
    m_fastest, claim, config = choice
    record_run("grouped_mm", _grouped_impl(*choice), "supported")
    return gemm_ws_host.launch_grouped_mm(a, b, ends, m_fastest=m_fastest, claim=claim, config=config)


def grouped_rows_mm_swiglu(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                           act_dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The reference forward's up projection and its SwiGLU in one launch: (h = [gate | up] [S, 2I], act [S, I] in
    act_dtype), the bits of grouped_rows_mm + moe_rows.swiglu_rows, by kosmos's grouped GEMM with its SwiGLU
    epilogue (gemm_ws_host.launch_grouped_mm_swiglu; the act without a second pass over h) where grouped_rows_mm
    would run kosmos's kernel and the epilogue takes the operands (I a multiple of 128); else None (the caller runs
    the matmul and the row kernel). KOSMOS_GROUPED_SWIGLU=0 switches it off. The report records which ran and
    why."""
    from kosmos.kernels import gemm_ws_host

    switch = env_choice("KOSMOS_GROUPED_SWIGLU", ("0", "1"), "1")
    choice = _grouped_choice(a, b, ends, record=False)  # torch's matmul: grouped_rows_mm records it
    if choice is None:
        return None
    reason = ("KOSMOS_GROUPED_SWIGLU=0" if switch == "0" else gemm_ws_host.swiglu_unsupported(a, b)
              or (None if act_dtype in gemm_ws_host.SWIGLU_ACT_DTYPES else f"act dtype {act_dtype}"))
    if reason is not None:
        record_run("grouped_mm_swiglu", "grouped matmul + SwiGLU row kernel", reason)
        return None
    m_fastest, claim, config = choice
    record_run("grouped_mm_swiglu", _grouped_impl(*choice) + " swiglu", "supported")
    return gemm_ws_host.launch_grouped_mm_swiglu(a, b, ends, m_fastest=m_fastest, claim=claim, config=config,
                                                 act_dtype=act_dtype)


GATHER_ENV = "KOSMOS_GROUPED_GATHER"


def grouped_rows_mm_swiglu_gathered(src: torch.Tensor, rows: torch.Tensor, b: torch.Tensor, ends: torch.Tensor,
                                    act_dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """grouped_rows_mm_swiglu of the rows src[rows] (zero rows where rows is not a row of src: the pad rows), gathered
    inside the launch by the grouped GEMM's producer (gemm_ws_host.launch_grouped_mm_swiglu's rows), so the gathered
    copy is never written; the same bits. Opt-in: KOSMOS_GROUPED_GATHER=1 (default 0: slower on the H200, figures
    in grouped_ws_gather's docstring). None where it is off, and where grouped_rows_mm_swiglu would not run its
    kernel or the gather cannot (recorded): the caller gathers the rows and asks that."""
    from kosmos.kernels import gemm_ws_host

    if env_choice(GATHER_ENV, ("0", "1"), "0") == "0":
        return None
    choice = _grouped_choice(src, b, ends, record=False, rows=rows.shape[0])
    reason = ("the up projection runs torch._grouped_mm" if choice is None else gemm_ws_host.swiglu_unsupported(src, b)
              or gemm_ws_host.gather_unsupported(src, rows)
              or (None if act_dtype in gemm_ws_host.SWIGLU_ACT_DTYPES else f"act dtype {act_dtype}"))
    if reason is not None:
        record_run("grouped_mm_gather", "moe_gather_rows, then the up projection", reason)
        return None
    record_run("grouped_mm_swiglu", _grouped_impl(*choice) + " swiglu gathered", "supported")
    m_fastest, claim, config = choice
    return gemm_ws_host.launch_grouped_mm_swiglu(src, b, ends, m_fastest=m_fastest, claim=claim, config=config,
                                                 act_dtype=act_dtype, rows=rows)


def grouped_rows_wgrad(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> Optional[torch.Tensor]:
    """The reference's weight gradients (ragged-K grouped matmul [E, M, N], out[e] = a_e^T @ b_e, zeros for an
    expert without rows) by kosmos's kernel (gemm_ws_host.grouped_wgrad) when it takes the operands and pays off,
    else None (the caller runs torch._grouped_mm). KOSMOS_GROUPED_WGRAD: auto (default: gradients of
    WGRAD_MIN_ELEMENTS elements or more, so every size), kosmos (whenever it takes them), torch (never). The report
    records which ran and why."""
    from kosmos.kernels import gemm_ws_host

    key = ("grouped_wgrad", launch_plan.tensor_key(a), launch_plan.tensor_key(b), ends.numel(),
           os.environ.get("KOSMOS_GROUPED_WGRAD"))
    mode, reason = _kept_choice(key, lambda: _kosmos_mode(
        "KOSMOS_GROUPED_WGRAD", ("auto", "kosmos", "torch"), lambda: gemm_ws_host.grouped_wgrad_unsupported(a, b),
        (a.shape[1], b.shape[1]), "gradient", "kosmos", WGRAD_MIN_ELEMENTS))
    if mode is None:
        record_run("grouped_wgrad", "torch._grouped_mm", reason)
        return None
    config = gemm_ws_host.wgrad_config(a.shape[0], ends.numel())
    tail = gemm_ws_host.wgrad_tail(config, a.shape[0], ends.numel())
    record_run("grouped_wgrad", f"kosmos grouped_wgrad_ws {config}{' tail tma' if tail == 'tma' else ''}", "supported")
    return gemm_ws_host.launch_grouped_wgrad(a, b, ends, config=config, tail=tail)


def router_rows_logits(hidden: torch.Tensor, router_weight: torch.Tensor,
                       router_bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The reference forward's fp32 router logits on bf16 hidden states by kosmos.kernels.router_gemm when it takes
    them, else None (the caller runs torch's fp32 GEMM). KOSMOS_ROUTER_GEMM: auto (default) or torch (never). The
    report records which ran and why."""
    from kosmos.kernels import router_gemm

    off = env_choice("KOSMOS_ROUTER_GEMM", ("auto", "torch"), "auto") == "torch"
    reason = "KOSMOS_ROUTER_GEMM=torch" if off else router_gemm.unsupported(hidden, router_weight, router_bias)
    if reason is not None:
        record_run("router_logits", "torch fp32 linear", reason)
        return None
    record_run("router_logits", "kosmos router_gemm", "fp32 router on bf16 hidden states, TF32 off")
    return router_gemm.launch_router_logits(hidden, router_weight, router_bias)


def route_rows_select(logits: torch.Tensor, score_correction_bias: Optional[torch.Tensor], top_k: int, scoring: str,
                      norm_topk_prob: bool, n_group: int, topk_group: int, routed_scaling_factor: float, eps: float,
                      weights_dtype: Optional[torch.dtype]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The reference forward's (topk_ids, topk_weights) from the router's logits by kosmos.kernels.route_select
    (the fused forward's selection, one launch) when it takes them, else None (the caller runs the torch ops).
    KOSMOS_ROUTE_SELECT: auto (default) or torch (never). The report records which ran and why."""
    from kosmos.kernels import route_select

    off = env_choice("KOSMOS_ROUTE_SELECT", ("auto", "torch"), "auto") == "torch"
    reason = "KOSMOS_ROUTE_SELECT=torch" if off else route_select.unsupported(
        logits, score_correction_bias, top_k, scoring, n_group, topk_group, weights_dtype)
    if reason is not None:
        record_run("router_select", "torch ops (softmax / sigmoid, topk, gather)", reason)
        return None
    record_run("router_select", "kosmos route_select", "the fused forward's selection")
    return route_select.launch_select(logits, score_correction_bias, top_k, scoring, norm_topk_prob, n_group,
                                      topk_group, routed_scaling_factor, eps, weights_dtype)


def route_rows_weights(logits: torch.Tensor, ids: torch.Tensor, scoring: str, norm_topk_prob: bool,
                       routed_scaling_factor: float, eps: float,
                       weights_dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """The reference backward's routing weights at the forward's kept ids by kosmos.kernels.route_backward (one
    launch) when it takes them, else None (the caller runs the torch ops). KOSMOS_ROUTE_BACKWARD: auto (default)
    or torch (never; for the logits' gradient too: it follows the weights). The report records which ran and why."""
    from kosmos.kernels import route_backward

    off = env_choice("KOSMOS_ROUTE_BACKWARD", ("auto", "torch"), "auto") == "torch"
    got = "KOSMOS_ROUTE_BACKWARD=torch" if off else route_backward.weights_or_reason(
        logits, ids, scoring, norm_topk_prob, routed_scaling_factor, eps, weights_dtype)
    if isinstance(got, str):
        record_run("router_backward", _ROUTER_BACKWARD_TORCH, got)
        return None
    return got


_ROUTER_BACKWARD_TORCH = "torch ops (scores, gather, renormalisation; their backward)"


def router_rows_d_logits(logits: torch.Tensor, ids: torch.Tensor, d_weights: torch.Tensor,
                         grad_logits: Optional[torch.Tensor], scoring: str, norm_topk_prob: bool,
                         routed_scaling_factor: float, eps: float) -> Optional[torch.Tensor]:
    """The reference backward's router logits gradient by kosmos.kernels.route_backward (one launch) after
    route_rows_weights ran, else None (the caller recomputes the scores and runs the torch ops). The report
    records which ran and why."""
    from kosmos.kernels import route_backward

    grad_logits = grad_logits.contiguous() if grad_logits is not None else None
    got = route_backward.d_logits_or_reason(logits, ids, d_weights.contiguous(), grad_logits, scoring, norm_topk_prob,
                                            routed_scaling_factor, eps)
    if isinstance(got, str):
        record_run("router_backward", _ROUTER_BACKWARD_TORCH, got)
        return None
    record_run("router_backward", "kosmos route_backward", "weights and logits gradient at the forward's choices")
    return got


def register() -> None:
    from kosmos.kernels import moe_pairs, moe_rows

    dispatch.register_fused("moe_layer", why_not_moe_layer, run_moe_layer, _layer_note)
    dispatch.register_fused("moe_layer_backward", why_not_moe_layer_backward, run_moe_layer_backward,
                            _layer_backward_note)
    dispatch.register_row_kernel("moe_swiglu_rows", moe_rows.swiglu_rows)
    dispatch.register_row_kernel("moe_swiglu_rows_backward", moe_rows.swiglu_rows_backward)
    dispatch.register_row_kernel("moe_fold", moe_rows.fold)
    dispatch.register_row_kernel("moe_gather_rows", moe_rows.gather_rows)
    dispatch.register_row_kernel("moe_sorted_pairs", moe_pairs.sorted_pairs)
    dispatch.register_row_kernel("moe_grouped_mm", grouped_rows_mm)
    dispatch.register_row_kernel("moe_grouped_mm_swiglu", grouped_rows_mm_swiglu)
    dispatch.register_row_kernel("moe_grouped_mm_swiglu_gathered", grouped_rows_mm_swiglu_gathered)
    dispatch.register_row_kernel("moe_grouped_wgrad", grouped_rows_wgrad)
    dispatch.register_row_kernel("moe_router_logits", router_rows_logits)
    dispatch.register_row_kernel("moe_route_select", route_rows_select)
    dispatch.register_row_kernel("moe_route_weights", route_rows_weights)
    dispatch.register_row_kernel("moe_router_d_logits", router_rows_d_logits)
