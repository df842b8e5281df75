"""fp32-accurate matmuls of fp32 operands on TF32 tensor cores: each inexact operand split into two TF32 parts.

x = hi + lo + r with hi = x rounded to TF32 (10 mantissa bits) and lo = (x - hi) rounded to TF32, so |r| is about
2^-22 |x|: fp32's own rounding level. TF32 multiplies its inputs exactly and the GEMM core accumulates in fp32, so
a @ b = a_hi b + a_lo b for a b that is exact in TF32 (an fp32 cast of bf16 / fp16 values, as the MoE router's
hidden states and weights usually are), and a_hi b_hi + a_hi b_lo + a_lo b_hi otherwise: two or three TF32
products, run as ONE plain TF32 GEMM of the GEMM core by concatenating the parts along K (or, where the split
operand is the small one and K is long, by stacking its parts along M and adding the two halves of the product).

Measured on the H200 (benchmarks/RESULTS.md, thirteenth session): tl.dot's own tf32x3 on these shapes (the
operands split inside the K loop) ran the DeepSeek-V3 router backward's two matmuls in 4.47 ms against cuBLAS
fp32's ~3.1 ms; the split here moves it out of the loop.
"""
from __future__ import annotations

from typing import Optional

import torch

from kosmos.kernels import gemm as gemm_core

_TF32_DROP = 13  # fp32 mantissa bits that TF32 drops


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to the nearest TF32 value (ties away from zero), as fp32."""
    bits = x.contiguous().view(torch.int32)
    half, mask = 1 << (_TF32_DROP - 1), ~((1 << _TF32_DROP) - 1)
    return ((bits + half) & mask).view(torch.float32)


def split_tf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = round_tf32(x)
    return hi, round_tf32(x - hi)


def matmul(a: torch.Tensor, b: torch.Tensor, a_exact: bool = False, b_exact: bool = False,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 a [M, K] @ b [K, N] (into out if given) as TF32 products of the operands' splits; a_exact / b_exact:
    the operand is exact in TF32 already (an fp32 cast of bf16 / fp16 values). Raises
    gemm.GemmUnsupported for operands the GEMM core cannot take (the caller runs torch's fp32 matmul)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise gemm_core.GemmUnsupported(f"tf32_split: float32 operands expected, got {a.dtype} and {b.dtype}")
    M, K = a.shape
    N = b.shape[1]
    if a_exact and b_exact:
        return gemm_core.gemm(a, b, out=out, precision="tf32")
    if b_exact and K * N > M * N:  # K long, a small: stack a's parts along M, add the two halves
        half = gemm_core.gemm(torch.cat(split_tf32(a), dim=0), b, precision="tf32")
        return torch.add(half[:M], half[M:], out=out)
    if a_exact and K * M > M * N:  # the same for a split b: its parts side by side along N
        half = gemm_core.gemm(a, torch.cat(split_tf32(b), dim=1), precision="tf32")
        return torch.add(half[:, :N], half[:, N:], out=out)
    if b_exact:
        a2, b2 = torch.cat(split_tf32(a), dim=1), torch.cat([b, b], dim=0)
    elif a_exact:
        a2, b2 = torch.cat([a, a], dim=1), torch.cat(split_tf32(b), dim=0)
    else:
        (a_hi, a_lo), (b_hi, b_lo) = split_tf32(a), split_tf32(b)
        a2, b2 = torch.cat([a_hi, a_hi, a_lo], dim=1), torch.cat([b_hi, b_lo, b_hi], dim=0)
    return gemm_core.gemm(a2, b2, out=out, precision="tf32")
