"""kosmos.kernels.route_select (the reference forward's routing selection by the fused forward's ROUTE code) on the
CPU under TRITON_INTERPRET=1 against the torch ops of kosmos.ops.moe_math._route_forward, in subprocesses
(tests/_interp.py); plus, in this process, the reasons it refuses inputs."""
from __future__ import annotations

import _interp
import pytest
import torch

# (T, E, k, scoring, norm, n_group, topk_group, scaling, correction bias, logits dtype, weights dtype): Qwen3-MoE's
# softmax router, DeepSeek-V3's group-limited sigmoid router with its bias, Mixtral's fp32 weights on 16-bit
# logits, top-1, rows past one tile and cut short. No bf16: the interpreter casts to bf16 by truncation.
CASES = {
    "softmax_norm_fp16": (70, 64, 8, "softmax", True, 1, 1, 1.0, False, torch.float16, None),
    "softmax_fp32_top1": (33, 16, 1, "softmax", False, 1, 1, 1.0, False, torch.float32, None),
    "softmax_fp16_fp32_weights": (40, 8, 2, "softmax", False, 1, 1, 1.0, False, torch.float16, torch.float32),
    "sigmoid_groups_bias_scaled": (50, 64, 6, "sigmoid", True, 8, 4, 2.5, True, torch.float32, None),
    "sigmoid_scaled_no_norm": (17, 32, 4, "sigmoid", False, 1, 1, 1.5, False, torch.float32, None),
}


def _check_case(T, E, k, scoring, norm, n_group, topk_group, scale, with_bias, dtype, weights_dtype):
    from kosmos.kernels import route_select
    from kosmos.ops import moe_math

    g = torch.Generator().manual_seed(T * E + k)
    logits = (3 * torch.randn(T, E, generator=g)).to(dtype)
    bias = torch.randn(E, generator=g) * 0.1 if with_bias else None
    eps = moe_math._SIGMOID_NORM_EPS if scoring == "sigmoid" else 0.0
    ids, weights = route_select.select(logits, bias, k, scoring, norm, n_group, topk_group, scale, eps, weights_dtype)
    router_weight = torch.empty(E, 1)  # the logits are given: the router GEMM does not run
    _, want_ids, want_w, _ = moe_math._route_forward(torch.empty(T, 1), router_weight, None, bias, k, scoring, norm,
                                                     n_group, topk_group, scale, None, logits=logits,
                                                     weights_dtype=weights_dtype)
    assert ids.dtype == torch.int64 and ids.shape == (T, k)
    assert weights.dtype == want_w.dtype and weights.shape == (T, k)
    # the same experts per row (torch's group-limited path returns them unsorted), each with the same weight
    order, want_order = ids.sort(dim=1), want_ids.sort(dim=1)
    assert torch.equal(order.values, want_order.values)
    got_w = weights.gather(1, order.indices).double()
    ref_w = want_w.gather(1, want_order.indices).double()
    # exp is the one approximation: fp32 weights agree to its last bits, 16-bit ones to one unit of the last place
    tol = 1e-6 if weights.dtype == torch.float32 else 2.0**-10
    err = ((got_w - ref_w).abs() / ref_w.abs().clamp(min=1e-30)).max().item()
    assert err <= tol, err
    return {"max_rel": err}


def _main():
    _interp.run_cases(list(CASES), {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()})


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=300)


@pytest.mark.parametrize("args,reason", [
    (((4, 300), None, 8, "softmax", 1, 1, None), "top-8 of 300 experts"),
    (((4, 64), None, 17, "softmax", 1, 1, None), "top-17 of 64 experts"),
    (((4, 64), None, 8, "softmax", 3, 1, None), "3 expert groups"),
    (((4, 64), None, 9, "softmax", 8, 1, None), "top-9 from 1 groups of 8 experts"),
    (((4, 64), None, 8, "entmax", 1, 1, None), "scoring 'entmax'"),
    (((4, 64), (32,), 8, "sigmoid", 1, 1, None), "score_correction_bias (32,)"),
    (((4, 64), None, 8, "softmax", 1, 1, torch.float16), "weights dtype torch.float16"),
    (((4, 64), None, 8, "softmax", 1, 1, None), "logits on cpu"),
])
def test_route_select_refusals(args, reason):
    """What the kernel does not take goes to the torch ops with this reason (moe_ops records it)."""
    from kosmos.kernels import route_select

    shape, bias, k, scoring, n_group, topk_group, weights_dtype = args
    logits = torch.zeros(shape, dtype=torch.bfloat16)
    bias = torch.zeros(bias) if bias is not None else None
    got = route_select.unsupported(logits, bias, k, scoring, n_group, topk_group, weights_dtype)
    assert got is not None and reason in got, got


def test_route_uses_torch_ops_off_cuda(monkeypatch):
    """route() on CPU tensors never asks for the kernel (row kernels are CUDA's), and KOSMOS_ROUTE_SELECT=torch
    records the torch ops with that reason."""
    import kosmos
    from kosmos.kernels import moe_ops
    from kosmos.ops import dispatch, moe_math

    assert dispatch.row_kernel("moe_route_select", torch.device("cpu")) is None
    h, w = torch.randn(5, 8), torch.randn(16, 8)
    logits, ids, weights = moe_math.route(h, w, None, None, 4, "softmax", True, 1, 1, 1.0, None)
    assert ids.shape == weights.shape == (5, 4) and logits.shape == (5, 16)
    monkeypatch.setenv("KOSMOS_ROUTE_SELECT", "torch")
    kosmos.reset_report()
    assert moe_ops.route_rows_select(logits, None, 4, "softmax", True, 1, 1, 1.0, 0.0, None) is None
    assert ("router_select", "torch ops (softmax / sigmoid, topk, gather)", "KOSMOS_ROUTE_SELECT=torch") in \
        kosmos.report().runtime
    monkeypatch.setenv("KOSMOS_ROUTE_SELECT", "on")
    with pytest.raises(ValueError, match="KOSMOS_ROUTE_SELECT"):
        moe_ops.route_rows_select(logits, None, 4, "softmax", True, 1, 1, 1.0, 0.0, None)


if __name__ == "__main__":
    _main()
