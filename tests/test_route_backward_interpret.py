"""kosmos.kernels.route_backward (the reference backward's router at the forward's kept choices: the routing
weights, the logits' gradient) on the CPU under TRITON_INTERPRET=1 against the torch ops of kosmos.ops.moe_math
(`_route_forward` with the ids given, `_router_d_logits`), in subprocesses (tests/_interp.py); plus, in this
process, the reasons it refuses inputs and the torch path a refusal of the second launch falls back to."""
from __future__ import annotations

import _interp
import pytest
import torch

# (T, E, k, scoring, norm, scaling, logits dtype, weights dtype, grad of the logits output): Qwen3-MoE's softmax
# router, DeepSeek-V3's fp32 sigmoid router (normalised, x2.5), Mixtral's fp32 weights on 16-bit logits, a 16-bit
# sigmoid router (every op rounded to fp16), top-1, rows past one tile and cut short. No bf16: the interpreter casts
# to bf16 by truncation.
CASES = {
    "softmax_norm_fp16": (70, 64, 8, "softmax", True, 1.0, torch.float16, None, False),
    "softmax_fp32_top1_logits_grad": (33, 16, 1, "softmax", False, 1.0, torch.float32, None, True),
    "softmax_fp16_fp32_weights": (40, 8, 2, "softmax", True, 1.0, torch.float16, torch.float32, True),
    "sigmoid_norm_scaled_fp32": (50, 64, 6, "sigmoid", True, 2.5, torch.float32, None, True),
    "sigmoid_fp16_scaled_no_norm": (17, 32, 4, "sigmoid", False, 1.5, torch.float16, None, False),
}


def _inputs(T, E, k, dtype, weights_dtype, with_glog):
    g = torch.Generator().manual_seed(T * E + k)
    logits = (3 * torch.randn(T, E, generator=g)).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    d_weights = torch.randn(T, k, generator=g).to(weights_dtype or dtype)
    glog = torch.randn(T, E, generator=g).to(dtype) if with_glog else None
    return logits, ids, d_weights, glog


def _reference(logits, ids, d_weights, glog, k, scoring, norm, scale, weights_dtype):
    from kosmos.ops import moe_math

    T, E = logits.shape
    routed = moe_math._route_forward(torch.empty(T, 1), torch.empty(E, 1), None, None, k, scoring, norm, 1, 1, scale,
                                     None, ids=ids, logits=logits, weights_dtype=weights_dtype)
    assert routed[3]["scores"] is not None  # the torch ops ran (no row kernels off CUDA)
    return routed[2], moe_math._router_d_logits(d_weights, glog, routed, scoring, scale)


def _rel(got, want):
    """Largest error over the largest magnitude of want (the d_logits of a row cancel: no per-element ratio)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


def _check_case(T, E, k, scoring, norm, scale, dtype, weights_dtype, with_glog):
    from kosmos.kernels import route_backward
    from kosmos.ops import moe_math

    logits, ids, d_weights, glog = _inputs(T, E, k, dtype, weights_dtype, with_glog)
    want_w, want_dl = _reference(logits, ids, d_weights, glog, k, scoring, norm, scale, weights_dtype)
    eps = moe_math._SIGMOID_NORM_EPS if scoring == "sigmoid" else 0.0
    w = route_backward.routing_weights_of(logits, ids, scoring, norm, scale, eps, weights_dtype)
    dl = route_backward.d_logits_of(logits, ids, d_weights, glog, scoring, norm, scale, eps)
    plans = len(route_backward._plans)
    # a second call takes the kept launches: no new plan, the same bits
    assert torch.equal(route_backward.routing_weights_of(logits, ids, scoring, norm, scale, eps, weights_dtype), w)
    assert torch.equal(route_backward.d_logits_of(logits, ids, d_weights, glog, scoring, norm, scale, eps), dl)
    assert len(route_backward._plans) == plans
    assert w.dtype == want_w.dtype and w.shape == (T, k)
    assert dl.dtype == dtype and dl.shape == (T, E)
    # exp is the one approximation: fp32 results agree to its last bits, 16-bit ones to a unit or two of the last
    # place (every op of the fp16 sigmoid router rounds)
    w_err = ((w.double() - want_w.double()).abs() / want_w.double().abs().clamp(min=1e-30)).max().item()
    assert w_err <= (2e-6 if w.dtype == torch.float32 else 2.0**-10), w_err
    dl_err = _rel(dl, want_dl)
    assert dl_err <= (1e-5 if dtype == torch.float32 else 4e-3), dl_err
    # a row's gradient is zero off its kept experts for sigmoid scoring (and without a logits gradient)
    if scoring == "sigmoid" and glog is None:
        off = torch.ones(T, E, dtype=torch.bool).scatter_(1, ids.long(), False)
        assert not dl[off].any()
    return {"w_rel": w_err, "dl_rel": dl_err}


def _main():
    _interp.run_cases(list(CASES), {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()})


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=300)


@pytest.mark.parametrize("args,reason", [
    (((4, 300), (4, 8), "softmax", None), "top-8 of 300 experts"),
    (((4, 64), (4, 17), "softmax", None), "top-17 of 64 experts"),
    (((4, 64), (5, 8), "softmax", None), "ids (5, 8)"),
    (((4, 64), (4, 8), "entmax", None), "scoring 'entmax'"),
    (((4, 64), (4, 8), "softmax", torch.float16), "weights dtype torch.float16"),
    (((4, 64), (4, 8), "softmax", None), "logits on cpu"),
])
def test_route_backward_refusals(args, reason):
    """What the kernels do not take goes to the torch ops with this reason (moe_ops records it)."""
    from kosmos.kernels import route_backward

    shape, ids_shape, scoring, weights_dtype = args
    logits = torch.zeros(shape, dtype=torch.bfloat16)
    ids = torch.zeros(ids_shape, dtype=torch.int32)
    got = route_backward.unsupported(logits, ids, scoring, weights_dtype)
    assert got is not None and reason in got, got


def test_a_refusal_is_kept_per_signature(monkeypatch):
    """The check runs on a signature's first call only; later calls of it get the kept reason."""
    from kosmos.kernels import route_backward

    calls = []
    real = route_backward.unsupported
    monkeypatch.setattr(route_backward, "unsupported", lambda *a: calls.append(1) or real(*a))
    logits, ids = torch.zeros(4, 64), torch.zeros(4, 8, dtype=torch.int32)
    for _ in range(3):
        got = route_backward.weights_or_reason(logits, ids, "softmax", True, 1.0, 0.0)
        assert got == "logits on cpu (a CUDA kernel)"
    assert len(calls) == 1
    with pytest.raises(ValueError, match="logits on cpu"):
        route_backward.routing_weights_of(logits, ids, "softmax", True, 1.0, 0.0)
    assert route_backward.weights_or_reason(logits[:3], ids[:3], "softmax", True, 1.0, 0.0) is not None
    assert len(calls) == 2  # another T: another signature


def test_route_backward_refuses_gradients_of_other_shapes():
    from kosmos.kernels import route_backward

    logits, ids = torch.zeros(4, 64), torch.zeros(4, 8, dtype=torch.int32)
    got = route_backward.unsupported(logits, ids, "softmax", None, torch.zeros(4, 7))
    assert got is not None and "gradient (4, 7)" in got, got
    got = route_backward.unsupported(logits, ids, "softmax", None, torch.zeros(4, 8), torch.zeros(4, 64).t())
    assert got is not None and "gradient (64, 4)" in got, got


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_d_logits_falls_back_to_torch_when_the_kernel_declines(monkeypatch, scoring):
    """A state from the weights' row kernel keeps no scores: where the logits gradient's kernel then declines,
    _router_d_logits recomputes them with torch's ops and gives the torch path's gradient. (Row kernels are CUDA's;
    here stand-ins on the CPU: the weights by the torch ops, a declining gradient kernel.)"""
    from kosmos.ops import dispatch, moe_math

    T, E, k, scale = 6, 16, 4, 2.5
    logits, ids, d_weights, glog = _inputs(T, E, k, torch.float32, None, True)
    want_w, want_dl = _reference(logits, ids, d_weights, glog, k, scoring, True, scale, None)
    asked = []

    def weights_kernel(lg, i, sc, norm, rsf, eps, wd):
        asked.append("weights")
        return moe_math._route_forward(lg, torch.empty(E, 1), None, None, k, sc, norm, 1, 1, rsf, None, ids=i,
                                       logits=lg, weights_dtype=wd, kernels=False)[2]

    def d_logits_kernel(*args):
        asked.append("d_logits")
        return None

    kernels = {"moe_route_weights": weights_kernel, "moe_router_d_logits": d_logits_kernel}
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: kernels.get(name))
    routed = moe_math._route_forward(torch.empty(T, 1), torch.empty(E, 1), None, None, k, scoring, True, 1, 1, scale,
                                     None, ids=ids, logits=logits)
    assert routed[3]["scores"] is None and torch.equal(routed[2], want_w)
    assert torch.equal(moe_math._router_d_logits(d_weights, glog, routed, scoring, scale), want_dl)
    assert asked == ["weights", "d_logits"]


def test_env_switch_sends_the_router_backward_to_torch(monkeypatch):
    import kosmos
    from kosmos.kernels import moe_ops

    monkeypatch.setenv("KOSMOS_ROUTE_BACKWARD", "torch")
    kosmos.reset_report()
    logits, ids = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int32)
    assert moe_ops.route_rows_weights(logits, ids, "softmax", True, 1.0, 0.0, None) is None
    assert ("router_backward", "torch ops (scores, gather, renormalisation; their backward)",
            "KOSMOS_ROUTE_BACKWARD=torch") in kosmos.report().runtime
    monkeypatch.setenv("KOSMOS_ROUTE_BACKWARD", "on")
    with pytest.raises(ValueError, match="KOSMOS_ROUTE_BACKWARD"):
        moe_ops.route_rows_weights(logits, ids, "softmax", True, 1.0, 0.0, None)


if __name__ == "__main__":
    _main()
