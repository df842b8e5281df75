"""kosmos.kernels.router_gemm (the reference forward's fp32 router on 16-bit hidden states) on the CPU under
TRITON_INTERPRET=1 against the fp64 product, in subprocesses (tests/_interp.py)."""
from __future__ import annotations

import _interp
import torch

# (T, H, E, bias): token and expert blocks cut short, one token, H past several K blocks, a router bias. fp16 hidden
# and parts: the interpreter casts to bf16 by truncation (the GPU test runs bf16 and DeepSeek-V3's sizes).
CASES = {
    "ragged_blocks": (70, 96, 40, False),
    "one_token": (1, 48, 16, False),
    "bias": (33, 64, 24, True),
}


def _fp16_parts(w: torch.Tensor) -> torch.Tensor:
    """split_router_weight's three parts, in fp16."""
    p0 = w.half()
    rest = w - p0.float()
    p1 = rest.half()
    return torch.stack([p0, p1, (rest - p1.float()).half()])


def _check_case(T, H, E, bias):
    from kosmos.kernels import router_gemm

    g = torch.Generator().manual_seed(T * H + E)
    hidden = torch.randn(T, H, generator=g).half()
    weight = torch.randn(E, H, generator=g) / H**0.5
    rb = torch.randn(E, generator=g) if bias else None
    got = router_gemm.launch(hidden, _fp16_parts(weight), rb, rbm=16, rbn=16, bkg=16, num_warps=4, num_stages=1)
    want = hidden.double() @ weight.double().T + (rb.double() if bias else 0)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    # fp16 parts keep 33 of the weight's bits within fp16's range: fp32 accuracy, not fp16's (1e-3)
    assert got.dtype == torch.float32 and got.shape == (T, E)
    assert err < 1e-6, err
    return {"max_rel": err}


def _main():
    _interp.run_cases(list(CASES), {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()})


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=300)


if __name__ == "__main__":
    _main()
