"""The reference forward's fp32 router on bf16 hidden states (DeepSeek-V3's) on the tensor cores, as the fused
forward runs it: the fused forward's RGEMM tile (moe_route.router_gemm_tile_tma) in a kernel of its own.

torch runs `F.linear(hidden.float(), weight.float())` with TF32 off as an fp32 GEMM on the CUDA cores, after an fp32
copy of the hidden states: 1.50 ms at DeepSeek-V3's T = 16384 on the H200, this kernel 0.29 ms (RESULTS.md,
thirty-ninth session). The weight goes in as three bf16 parts (moe.split_router_weight, within 2**-24 of it) and each
K block's three bf16 dots are summed on the tensor cores and added to an fp32 accumulator: products of bf16 values
are exact in fp32, so the logits are as close to the exact product as cuBLAS's fp32 GEMM's (a GPU test checks it
against fp64).
Registered as the row kernel "moe_router_logits" (kosmos.ops.moe_math.route)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kosmos.kernels import runtime
from kosmos.kernels.moe_route import router_gemm_tile_tma

# (tokens, experts, K block, warps, stages) of a tile. Measured on the H200 at DeepSeek-V3's sizes
# (benchmarks/router_gemm.py, RESULTS.md thirty-ninth session): 128 x 128 tiles with 64-wide K blocks 0.286 ms at
# T = 16384 and 0.144 at 8192 (the fused forward's 128 x 128 x 32 tile 0.358 / 0.180); at T = 4096, where they
# leave more than half of the 132 SMs idle, 64-token tiles 0.094 ms (128-token 0.141).
CONFIGS = {"wide": (128, 128, 64, 8, 3), "narrow": (64, 128, 64, 4, 3)}


def config(T: int, E: int, device: torch.device) -> tuple:
    """The CONFIGS entry for T tokens and E experts: "wide" where its tiles fill half of the GPU's SMs or more."""
    rbm, rbn = CONFIGS["wide"][:2]
    tiles = triton.cdiv(T, rbm) * triton.cdiv(E, rbn)
    return CONFIGS["wide" if 2 * tiles >= runtime.num_sms(device) else "narrow"]


@triton.jit
def _router_logits_kernel(xr_desc, wr_desc, rb, logits, T, H, E, HAS_RB: tl.constexpr, RBM: tl.constexpr,
                          RBN: tl.constexpr, BKG: tl.constexpr):
    router_gemm_tile_tma(tl.program_id(0), xr_desc, wr_desc, rb, logits, T, H, E, HAS_RB, RBM, RBN, BKG)


def unsupported(hidden: torch.Tensor, router_weight: torch.Tensor,
                router_bias: Optional[torch.Tensor]) -> Optional[str]:
    """Why router_logits cannot compute these logits as torch would (then the caller runs torch's GEMM), or None."""
    if torch.backends.cuda.matmul.allow_tf32:
        return "allow_tf32 is on: torch's fp32 router GEMM runs in TF32, which this kernel does not reproduce"
    if hidden.dtype != torch.bfloat16 or hidden.dim() != 2:
        return f"hidden {hidden.dtype} {tuple(hidden.shape)}: 2-D bf16 expected (a bf16 value is exact in a part)"
    if router_weight.dtype not in (torch.float32, torch.bfloat16) or router_weight.dim() != 2:
        return f"router weight {router_weight.dtype} {tuple(router_weight.shape)}: 2-D fp32 or bf16 expected"
    E, H = router_weight.shape
    if hidden.shape[1] != H:
        return f"hidden {tuple(hidden.shape)} does not match the router weight {tuple(router_weight.shape)}"
    if router_bias is not None and (router_bias.shape != (E,) or not router_bias.dtype.is_floating_point):
        return f"router bias {router_bias.dtype} {tuple(router_bias.shape)}: a float [{E}] expected"
    if (hidden.stride(1) != 1 or (hidden.stride(0) * 2) % 16 or hidden.data_ptr() % 16 or H % 8
            or 3 * E * H >= 2**31):
        return (f"hidden strides {hidden.stride()} / H {H} / E {E}: TMA needs unit column stride, 16-byte aligned "
                "rows and H % 8 == 0")
    return None


def router_logits(hidden: torch.Tensor, router_weight: torch.Tensor,
                  router_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 logits [T, E] = hidden @ router_weight^T (+ router_bias) with fp32 operands' accuracy; raises where
    `unsupported` gives a reason."""
    reason = unsupported(hidden, router_weight, router_bias)
    if reason is not None:
        raise ValueError(f"kosmos router_gemm: {reason}")
    return launch_router_logits(hidden, router_weight, router_bias)


def launch_router_logits(hidden: torch.Tensor, router_weight: torch.Tensor,
                         router_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """router_logits for operands `unsupported` has already accepted: the weight split, the tile config, the
    launch."""
    from kosmos.kernels.moe import split_router_weight

    rbm, rbn, bkg, warps, stages = config(hidden.shape[0], router_weight.shape[0], hidden.device)
    return launch(hidden, split_router_weight(router_weight.float().contiguous()), router_bias, rbm, rbn, bkg, warps,
                  stages)


def launch(hidden: torch.Tensor, parts: torch.Tensor, router_bias: Optional[torch.Tensor] = None, rbm: int = 128,
           rbn: int = 128, bkg: int = 64, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """The kernel on 16-bit hidden [T, H] and the weight's parts [3, E, H] of hidden's dtype: fp32 logits [T, E]."""
    T, H = hidden.shape
    E = parts.shape[1]
    if parts.shape != (3, E, H) or parts.dtype != hidden.dtype or not parts.is_contiguous():
        raise ValueError(f"kosmos router_gemm: parts {parts.dtype} {tuple(parts.shape)} are not a contiguous "
                         f"{hidden.dtype} [3, E, {H}]")
    logits = torch.empty(T, E, dtype=torch.float32, device=hidden.device)
    if T == 0:
        return logits
    xr_desc = TensorDescriptor(hidden, [T, H], [hidden.stride(0), 1], [rbm, bkg])
    wr_desc = TensorDescriptor(parts.view(3 * E, H), [3 * E, H], [H, 1], [rbn, bkg])
    grid = (triton.cdiv(T, rbm) * triton.cdiv(E, rbn),)
    _router_logits_kernel[grid](xr_desc, wr_desc, router_bias if router_bias is not None else logits, logits, T, H, E,
                                HAS_RB=router_bias is not None, RBM=rbm, RBN=rbn, BKG=bkg, num_warps=num_warps,
                                num_stages=num_stages, **runtime.COMPILE_OPTIONS)
    return logits
