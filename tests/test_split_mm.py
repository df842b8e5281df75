"""fp32 matmuls as bf16 part products (kosmos.ops.split_mm): as accurate as an fp32 GEMM, both ways of summing the
parts, operands known to hold bf16 values taken as one part; where it is not used, torch's matmul unchanged."""
from __future__ import annotations

import pytest
import torch

from kosmos.ops import split_mm


def _operands(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = lambda *s: torch.exp(torch.randn(*s, generator=g) * 2)  # noqa: E731  (values over many binades)
    return torch.randn(m, k, generator=g) * scale(m, 1), torch.randn(k, n, generator=g) * scale(1, n)


def _err(out, a, b):
    ref = a.double() @ b.double()
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def _fp32_bar(a, b) -> float:
    """What "as accurate as an fp32 GEMM" allows: 8x the error of torch's fp32 matmul of a and b against fp64 (the
    parts' 3K or 6K products are summed in another order and number), at least 2^-20; one bf16 part per operand
    (a plain bf16 matmul) is off by ~2^-9."""
    return max(8 * _err(a @ b, a, b), 2.0**-20)


class _Counting:
    def __init__(self):
        self.shapes = []

    def __call__(self, a, b, out=None):
        self.shapes.append((tuple(a.shape), tuple(b.shape)))
        return split_mm._mm_f32(a, b, out=out)


@pytest.mark.parametrize("m,k,n,one_gemm", [(512, 16, 384, True), (8, 2048, 16, False)])
@pytest.mark.parametrize("b_exact", [False, True])
def test_split_mm_as_accurate_as_fp32(m, k, n, one_gemm, b_exact):
    """Six part products (three with an exact operand), side by side along K in one GEMM when the output is large,
    else one GEMM each; the error against fp64 within _fp32_bar."""
    a, b = _operands(m, k, n)
    if b_exact:
        b = b.bfloat16().float()
    mm = _Counting()
    out = split_mm.split_mm(a, b, b_exact=b_exact, mm=mm)
    pairs = 3 if b_exact else 6
    assert len(mm.shapes) == (1 if one_gemm else pairs)
    if one_gemm:
        assert mm.shapes[0] == ((m, pairs * k), (pairs * k, n))
    assert out.dtype == torch.float32
    assert _err(out, a, b) <= _fp32_bar(a, b)
    # a bf16 tensor is its own (exact) part: the same products
    if b_exact:
        torch.testing.assert_close(split_mm.split_mm(a, b.bfloat16(), mm=mm), out, rtol=0, atol=0)


@pytest.mark.parametrize("room", [1 << 20, 1000])
def test_split_mm_operands_in_a_workspace(room):
    """The side-by-side operands and the residual go into the workspace given (dead memory of the caller) where
    they fit, else into new tensors: the same result either way."""
    a, b = _operands(512, 16, 384)
    workspace = torch.zeros(room, dtype=torch.uint8)
    out = split_mm.split_mm(a, b, workspace=workspace)
    torch.testing.assert_close(out, split_mm.split_mm(a, b), rtol=0, atol=0)
    assert bool(workspace.any()) == (room > 1000)


def test_hi_part_alone_is_not_enough():
    """The check above can fail: one bf16 part per operand (what a plain bf16 matmul computes) is far off."""
    a, b = _operands(64, 256, 32)
    hi = split_mm._mm_f32(a.bfloat16(), b.bfloat16())
    assert _err(hi, a, b) > 100 * _fp32_bar(a, b)


def test_split_mm_into_out():
    a, b = _operands(64, 32, 48)
    out = torch.full((64, 48), float("nan"))
    res = split_mm.split_mm(a, b, out=out)
    assert res.data_ptr() == out.data_ptr() and not out.isnan().any()
    torch.testing.assert_close(out, split_mm.split_mm(a, b), rtol=0, atol=0)


def test_fp32_mm_is_torchs_where_not_supported():
    """CPU tensors (and, on CUDA, TF32 allowed): torch's matmul, bit for bit, in the promoted dtype."""
    a, b = _operands(32, 64, 16)
    assert not split_mm.supported(a, b)
    torch.testing.assert_close(split_mm.fp32_mm(a, b), a @ b, rtol=0, atol=0)
    torch.testing.assert_close(split_mm.fp32_mm(a, b.bfloat16()), a @ b.bfloat16().float(), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_mm_cuda_for_16bit_results():
    """On CUDA (bf16 tensor cores, aten::mm.dtype), the DeepSeek-V3 router backward's shapes (d_logits^T @ hidden,
    d_logits @ weight, with a bf16-valued and with an fp32 weight): the error against fp64 is far below the bf16
    rounding the result gets next (2^-9) and 50x below a plain bf16 GEMM's. The tensor cores' accumulation keeps
    fewer bits than cuBLAS's fp32 GEMM (printed), which is why fp32_mm takes the split only for results rounded to
    16 bits, and not with TF32 allowed."""
    d_logits, hidden = _operands(256, 4096, 7168)
    d_logits, hidden = d_logits.cuda(), hidden.cuda().bfloat16().float()
    weight = torch.randn(256, 7168, device="cuda") * 0.02
    cases = [(d_logits, hidden, True), (d_logits.t().contiguous(), weight.bfloat16().float(), True),
             (d_logits.t().contiguous(), weight, False)]
    for a, b, b_exact in cases:
        assert split_mm.supported(a, b)
        torch.testing.assert_close(split_mm.fp32_mm(a, b, b_exact=b_exact), a @ b, rtol=0, atol=0)  # not rounded
        out = split_mm.fp32_mm(a, b, b_exact=b_exact, rounded_to=torch.bfloat16)
        plain = split_mm._mm_f32(a.bfloat16(), b.bfloat16())
        err, cublas, bf16 = _err(out, a, b), _err(a @ b, a, b), _err(plain, a, b)
        print(f"{tuple(a.shape)} @ {tuple(b.shape)} exact b {b_exact}: split {err:.2e}, cuBLAS fp32 {cublas:.2e}, "
              f"bf16 {bf16:.2e}")
        assert err <= 2.0**-9 / 64 and err <= bf16 / 50
    with _tf32():
        assert not split_mm.supported(d_logits, hidden)


class _tf32:
    def __enter__(self):
        self.old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.old
