"""kosmos.kernels.moe_rows' forward SwiGLU row kernel on the CPU under TRITON_INTERPRET=1 against the torch math of
kosmos.ops.moe_math._swiglu (the reference forward's act), in subprocesses (tests/_interp.py)."""
from __future__ import annotations

import _interp
import torch

# (S, I, h dtype, act dtype): rows and columns past one block each and cut short, one row, fp32, act in another
# dtype. No bf16: the interpreter casts to bf16 by truncation, not to nearest (the GPU test covers bf16).
CASES = {
    "fp16_ragged_blocks": (70, 300, torch.float16, torch.float16),
    "fp16_one_row": (1, 40, torch.float16, torch.float16),
    "fp32": (65, 257, torch.float32, torch.float32),
    "fp16_rows_fp32_act": (33, 64, torch.float16, torch.float32),
}


def _check_case(S, I, dtype, act_dtype):
    import triton

    from kosmos.kernels import moe_rows
    from kosmos.ops import moe_math

    g = torch.Generator().manual_seed(S * I)
    h = (4 * torch.randn(S, 2 * I, generator=g)).to(dtype)
    want = moe_math._swiglu(h, act_dtype)[3]
    got = torch.full((S, I), float("nan"), dtype=act_dtype)
    moe_rows._swiglu_rows_kernel[(triton.cdiv(S, 64), triton.cdiv(I, 256))](h, got, S, I, BR=64, BC=256)
    # silu's exp is the one approximation: in fp32 it shows in the last bits, in fp16 the roundings hide it except
    # next to a rounding boundary (one value in thousands, one unit in the last place)
    differ = (got != want).sum().item()
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-30)).max().item()
    assert err <= (1e-6 if dtype == torch.float32 else 2.0**-10), (differ, err)
    assert dtype == torch.float32 or differ <= S * I // 1000, (differ, err)
    return {"differing": differ, "max_rel": err}


def _main():
    _interp.run_cases(list(CASES), {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()})


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=300)


if __name__ == "__main__":
    _main()
