"""fp32 matrix products on bf16 tensor cores, for results rounded to 16 bits afterwards: each fp32 operand split into
bf16 parts (hi + mid + lo carry its 24 bits), the part products that matter summed in fp32. The tensor cores'
accumulation keeps fewer bits than an fp32 GEMM's FMAs (on the H200 about 5e-6 of the result's scale where cuBLAS's
fp32 GEMM is at 3e-7, tests/test_split_mm.py), far below the 2^-9 of the bf16 result, so the split is taken only
where the result is rounded to bf16 / fp16 next; elsewhere torch's fp32 matmul stays. Speed: a few bf16 GEMMs against
fp32's non-tensor-core rate (~35 TF/s for the fp32 router matmuls of DeepSeek-V3's backward on the H200). The fused
MoE forward's fp32 router uses the same scheme (three bf16 dots). An operand whose values come from a bf16 tensor is
one part."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def bf16_parts(t: torch.Tensor, exact: bool) -> list:
    """fp32 t as bf16 tensors [hi, mid, lo] whose fp32 sum is t to 24 bits ([hi] alone if t's values are bf16's:
    exact, or t a bf16 tensor)."""
    hi = t.to(torch.bfloat16)
    if exact or t.dtype == torch.bfloat16:
        return [hi]
    rest = t - hi.float()
    mid = rest.to(torch.bfloat16)
    return [hi, mid, (rest - mid.float()).to(torch.bfloat16)]


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 a @ b accumulated and returned in fp32 (cuBLAS; on the CPU the same products through fp32, for tests)."""
    if a.is_cuda:
        if out is not None:
            return torch.ops.aten.mm.dtype_out(a, b, torch.float32, out=out)
        return torch.ops.aten.mm.dtype(a, b, torch.float32)
    return torch.mm(a.float(), b.float(), out=out)


class _Carver:
    """Tensors cut from a byte workspace in turn (256-byte aligned), or allocated when it is used up / not given."""

    def __init__(self, workspace: Optional[torch.Tensor], device):
        self.workspace, self.offset, self.device = workspace, 0, device

    def empty(self, shape, dtype) -> torch.Tensor:
        nbytes = dtype.itemsize * shape[0] * shape[1]
        ws = self.workspace
        if ws is not None and self.offset + nbytes <= ws.numel():
            t = ws[self.offset : self.offset + nbytes].view(dtype).view(shape)
            self.offset += -(-nbytes // 256) * 256
            return t
        return torch.empty(shape, dtype=dtype, device=self.device)


def _write_parts(t: torch.Tensor, dests: list, carve: _Carver) -> None:
    """t's bf16 parts into dests ([hi] or [hi, mid, lo], bf16 views), with one fp32 residual buffer."""
    dests[0].copy_(t)
    if len(dests) > 1:
        rest = carve.empty(tuple(t.shape), torch.float32)
        torch.sub(t, dests[0], out=rest)
        dests[1].copy_(rest)
        rest.sub_(dests[1])
        dests[2].copy_(rest)


def split_mm(a: torch.Tensor, b: torch.Tensor, a_exact: bool = False, b_exact: bool = False,
             out: Optional[torch.Tensor] = None, mm: Callable = _mm_f32,
             workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 a [M, K] @ b [K, N] as bf16 part products (parts i of a, j of b with i + j <= 2: hi*hi, hi*mid, mid*hi,
    hi*lo, lo*hi, mid*mid), into `out` if given. The parts go side by side along K in one GEMM when that copies less
    than summing separate products' [M, N] fp32 outputs would move (a large output), else one GEMM per part pair.
    workspace (uint8, optional): memory the side-by-side operands and their residual may use (so they need no new
    allocation where the caller has dead memory at hand)."""
    na = 1 if a_exact or a.dtype == torch.bfloat16 else 3
    nb = 1 if b_exact or b.dtype == torch.bfloat16 else 3
    pairs = [(i, j) for i in range(na) for j in range(nb) if i + j <= 2]
    (m, k), n = a.shape, b.shape[1]
    concat_bytes = 2 * len(pairs) * (m * k + k * n)
    separate_bytes = 12 * (len(pairs) - 1) * m * n
    if len(pairs) > 1 and concat_bytes < separate_bytes:
        carve = _Carver(workspace, a.device)
        a_cat = carve.empty((m, len(pairs) * k), torch.bfloat16)
        b_cat = carve.empty((len(pairs) * k, n), torch.bfloat16)
        a_blocks = [a_cat[:, p * k : (p + 1) * k] for p in range(len(pairs))]
        b_blocks = [b_cat[p * k : (p + 1) * k] for p in range(len(pairs))]
        for t, blocks, side in ((a, a_blocks, 0), (b, b_blocks, 1)):
            count = na if side == 0 else nb
            first = [[p for p, pair in enumerate(pairs) if pair[side] == i][0] for i in range(count)]
            _write_parts(t, [blocks[p] for p in first], carve)
            for p, pair in enumerate(pairs):
                if p not in first:
                    blocks[p].copy_(blocks[first[pair[side]]])
        return mm(a_cat, b_cat, out=out)
    pa, pb = bf16_parts(a, a_exact), bf16_parts(b, b_exact)
    result = mm(pa[pairs[0][0]], pb[pairs[0][1]], out=out)
    for i, j in pairs[1:]:
        result.add_(mm(pa[i], pb[j]))
    return result


def supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a @ b should go through split_mm: CUDA operands, fp32 or bf16 (a bf16 one is its own part), at least
    one fp32; the fp32 matmul precision "highest" (with TF32 allowed cuBLAS uses tensor cores already, at TF32's
    precision); torch's mm with an fp32 output dtype (aten::mm.dtype)."""
    dtypes = (torch.float32, torch.bfloat16)
    return (a.is_cuda and b.is_cuda and a.dtype in dtypes and b.dtype in dtypes
            and torch.float32 in (a.dtype, b.dtype)
            and torch.get_float32_matmul_precision() == "highest"
            and "dtype" in torch.ops.aten.mm.overloads())


def fp32_mm(a: torch.Tensor, b: torch.Tensor, a_exact: bool = False, b_exact: bool = False,
            out: Optional[torch.Tensor] = None, rounded_to: Optional[torch.dtype] = None,
            workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a @ b (into out if given; fp32 if either is): split_mm where `supported` and the caller rounds the result to
    `rounded_to`, a 16-bit dtype, next; else torch's (in the promoted dtype)."""
    if rounded_to is not None and rounded_to.itemsize == 2 and supported(a, b):
        return split_mm(a, b, a_exact, b_exact, out=out, workspace=workspace)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return torch.mm(a.to(dtype), b.to(dtype), out=out)
