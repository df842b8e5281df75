"""The fused MoE backward kernel (kosmos.kernels.moe_backward) on the CPU under TRITON_INTERPRET=1, against the
reference `moe_layer_backward` math of kosmos.ops.moe (`_route_forward`, `experts_backward`, `route_backward`) on
the same inputs, plus its gate (kosmos.kernels.moe_ops.why_not_moe_layer_backward) in-process.

The interpreter runs programs one after another: the first program claims and runs every task (each wait is on a
task it ran itself earlier), the others find the queue empty; so grids of 1 and 3 programs both run here and must
give the same bits. fp16 / fp32 only (the interpreter's tl.dot on bf16 multiplies raw bits).

The kernel cases run in subprocesses, one per core (tests/_interp.py; TRITON_INTERPRET must be set before triton is
imported and must not leak into other tests); each test checks its case's line of the report.
"""
from __future__ import annotations

import _interp
import torch

CASES = ["fp16_top2_renorm", "fp32_top1_bias_scaled_glog", "fp16_router_fp32_no_renorm_glog", "empty_experts",
         "all_on_one_expert", "many_blocks_per_expert", "mixed_hidden_fp32_weights_fp16", "top2_one_token",
         "counters_zeroed_and_error_word", "spin_bound_records_the_waiting_task", "deepseek_v3_router_fp32", "sigmoid_fp16_bias_renorm",
         "softmax_grouped_corrected_fp16"]

NAMES = ["d_hidden", "d_router_weight", "d_gate_up_proj", "d_down_proj", "d_router_bias"]


# ----------------------------------------------------------------------------------------------- cases (subprocess)


def _inputs(torch, T, H, I, E, dtype, seed, wdtype=None, router_scale=0.5):
    g = torch.Generator().manual_seed(seed)
    wdtype = wdtype or dtype
    h = torch.randn(T, H, generator=g).to(dtype)
    rw = (torch.randn(E, H, generator=g) * router_scale).to(dtype)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(wdtype)
    d = (torch.randn(E, H, I, generator=g) * 0.2).to(wdtype)
    go = torch.randn(T, H, generator=g).to(dtype)
    return h, rw, gu, d, go


def _reference(go, glog, h, rw, rb, cb, gu, d, top_k, scoring, norm, n_group, topk_group, rsf, router_dtype):
    """kosmos::moe_layer_backward's reference impl (ep_group_name None), its math called directly."""
    from kosmos.ops.moe_math import _route_forward, experts_backward, route_backward

    routed = _route_forward(h, rw, rb, cb, top_k, scoring, norm, n_group, topk_group, rsf, router_dtype)
    _, ids, weights, _ = routed
    d_hidden, d_weights, d_gu, d_down = experts_backward(go, h, ids, weights, gu, d)
    d_hidden_router, d_rw, d_rb = route_backward(d_weights, glog, routed, rw, rb, scoring, rsf)
    grads = [(d_hidden + d_hidden_router).to(h.dtype), d_rw, d_gu, d_down]
    return grads + ([d_rb] if rb is not None else []), ids


def _check(torch, h, rw, gu, d, go, top_k, *, tol, router_bias=None, norm=True, rsf=1.0, router_dtype=None,
           programs=(1, 3), scoring="softmax", correction=None, n_group=1, topk_group=1, glog=None, tols=None):
    """Runs the kernel with each grid size (outputs poisoned by fresh allocations: torch.empty), checks the runs are
    bit-identical, dtypes / shapes, and every gradient against the reference; returns the relative errors."""
    from kosmos.kernels.moe_backward import moe_backward

    ref, ids = _reference(go, glog, h, rw, router_bias, correction, gu, d, top_k, scoring, norm, n_group, topk_group,
                          rsf, router_dtype)
    runs = []
    for p in programs:
        runs.append(moe_backward(go, glog, h, rw, router_bias, correction, gu, d, top_k, scoring, norm, n_group,
                                 topk_group, rsf, router_dtype, programs=p))
    for other in runs[1:]:
        assert len(other) == len(runs[0])
        for name, a, b in zip(NAMES, runs[0], other):
            assert torch.equal(a, b), f"{name}: grid sizes not bit-identical"
    got = runs[0]
    assert len(got) == len(ref), (len(got), len(ref))
    errs = {}
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.isfinite(a).all(), name
        den = b.double().norm()
        err = float((a.double() - b.double()).norm() / den) if den > 0 else float(a.double().norm())
        errs[name] = err
        limit = (tols or {}).get(name, tol)
        assert err <= limit, (name, err, limit)
    counts = torch.bincount(ids.reshape(-1), minlength=gu.shape[0]).tolist()
    return {"errs": errs, "counts": counts}


def case_fp16_top2_renorm(torch):
    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 4, torch.float16, 0)  # T=20: not a multiple of the 16-token tile
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3)


def case_fp32_top1_bias_scaled_glog(torch):
    h, rw, gu, d, go = _inputs(torch, 19, 32, 16, 4, torch.float32, 1)
    bias = torch.randn(4, generator=torch.Generator().manual_seed(5)) * 0.3
    glog = torch.randn(19, 4, generator=torch.Generator().manual_seed(6))
    return _check(torch, h, rw, gu, d, go, 1, tol=1e-5, router_bias=bias, norm=False, rsf=2.5, glog=glog)


def case_fp16_router_fp32_no_renorm_glog(torch):
    h, rw, gu, d, go = _inputs(torch, 24, 32, 16, 6, torch.float16, 2)
    glog = torch.randn(24, 6, generator=torch.Generator().manual_seed(7))  # logits dtype fp32
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3, norm=False, router_dtype=torch.float32, glog=glog)


def case_empty_experts(torch):
    h, rw, gu, d, go = _inputs(torch, 21, 32, 16, 8, torch.float16, 3)
    bias = torch.zeros(8, dtype=torch.float16)
    bias[[1, 4, 6]] = -30.0  # never chosen: zero d_gate_up / d_down for them
    res = _check(torch, h, rw, gu, d, go, 2, tol=3e-3, router_bias=bias, tols={"d_router_bias": 1e-2})
    assert [res["counts"][i] for i in (1, 4, 6)] == [0, 0, 0], res
    return res


def case_all_on_one_expert(torch):
    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 4, torch.float32, 4)
    bias = torch.tensor([0.0, 0.0, 40.0, 0.0])
    # top-1 on a saturated softmax: the router gradients are ~0 (relative errors meaningless), so only the experts'
    res = _check(torch, h, rw, gu, d, go, 1, tol=1e-5, router_bias=bias,
                 tols={"d_router_weight": 1.0, "d_router_bias": 1.0})
    assert res["counts"] == [0, 0, 20, 0], res
    res2 = _check(torch, h, rw, gu, d, go, 2, tol=1e-5, router_bias=bias,
                  tols={"d_router_weight": 1e-4, "d_router_bias": 1e-4})
    assert res2["counts"][2] == 20, res2
    return {"top1": res, "top2": res2}


def case_many_blocks_per_expert(torch):
    # 70 tokens x top-2 over 4 experts: several 16-row blocks per expert, 5 token tiles, H and I over 2 chunks
    h, rw, gu, d, go = _inputs(torch, 70, 64, 32, 4, torch.float16, 6)
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3)


def case_mixed_hidden_fp32_weights_fp16(torch):
    h, rw, gu, d, go = _inputs(torch, 18, 32, 16, 4, torch.float32, 7, wdtype=torch.float16)
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3)


def case_top2_one_token(torch):
    h, rw, gu, d, go = _inputs(torch, 1, 32, 16, 4, torch.float16, 8)  # T*k = 2 < E: two experts without rows
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3)


def case_counters_zeroed_and_error_word(torch):
    from kosmos.kernels import moe
    from kosmos.kernels import moe_backward as mb

    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 4, torch.float16, 9)
    mb.moe_backward(go, None, h, rw, None, None, gu, d, 2, programs=2)
    ctl = mb.control(h.device)
    assert int(ctl.ctrl.abs().sum()) == 0, ctl.ctrl.tolist()  # the last program zeroed every counter
    ctl.err_host[3] = 17
    ctl.err_host[0] = 1  # what a timed-out spin leaves in the host mirror
    msgs = _interp.timeout_then_broken(lambda: mb.moe_backward(go, None, h, rw, None, None, gu, d, 2))
    assert "moe_layer_backward" in msgs[0] and "task 17" in msgs[0], msgs
    moe._controls.clear()  # the registry of every MoE kernel's control tensor
    out = mb.moe_backward(go, None, h, rw, None, None, gu, d, 2)[0]  # a fresh control tensor works again
    assert torch.isfinite(out).all()
    return {"msgs": msgs}



def case_spin_bound_records_the_waiting_task(torch):
    # as the forward's case: the claim counter starts at 1, ROUTE task 0 never runs, the SCAN task (index n_tiles)
    # spins to the bound; the kernel's error words and the host mirror name it, and the next call raises
    from kosmos.kernels import moe, runtime
    from kosmos.kernels import moe_backward as mb

    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 4, torch.float16, 9)
    moe._controls.clear()
    mb.moe_backward(go, None, h, rw, None, None, gu, d, 2)  # sizes the control tensor
    ctl = mb.control(h.device)
    scan_task = -(-20 // mb.CONFIGS["interpret"].bt)
    ctl.ctrl[mb.C_CLAIM.value] = 1
    runtime.set_spin_timeout(0.0002)
    try:
        mb.moe_backward(go, None, h, rw, None, None, gu, d, 2, programs=1)
    finally:
        runtime.set_spin_timeout(None)
    err = mb.C_ERR.value
    assert ctl.ctrl[err:err + 3].tolist() == [1, mb.OP_ID.value, scan_task], ctl.ctrl.tolist()
    assert ctl.err_host.tolist() == [1, mb.OP_ID.value, 0, scan_task], ctl.err_host.tolist()
    msgs = _interp.timeout_then_broken(lambda: mb.moe_backward(go, None, h, rw, None, None, gu, d, 2))
    assert "moe_layer_backward" in msgs[0] and f"task {scan_task}" in msgs[0], msgs
    moe._controls.clear()
    return {"msgs": msgs}

def case_deepseek_v3_router_fp32(torch):
    # sigmoid, correction bias, 4 groups of 4 (top-2 groups), top-3, renorm + 1e-20, scaling 2.5, fp32 router
    h, rw, gu, d, go = _inputs(torch, 22, 32, 16, 16, torch.float16, 10)
    corr = torch.linspace(-0.05, 0.05, 16)
    return _check(torch, h, rw, gu, d, go, 3, tol=3e-3, scoring="sigmoid", correction=corr, n_group=4, topk_group=2,
                  rsf=2.5, router_dtype=torch.float32)


def case_sigmoid_fp16_bias_renorm(torch):
    # sigmoid scores in fp16 (the logits dtype): every router op, forward and backward, rounds to fp16
    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 8, torch.float16, 11)
    bias = torch.linspace(-0.1, 0.1, 8).half()
    glog = torch.randn(20, 8, generator=torch.Generator().manual_seed(12)).half()
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3, scoring="sigmoid", router_bias=bias, glog=glog,
                  tols={"d_router_weight": 1e-2, "d_router_bias": 1e-2})


def case_softmax_grouped_corrected_fp16(torch):
    h, rw, gu, d, go = _inputs(torch, 20, 32, 16, 8, torch.float16, 12)
    corr = torch.linspace(0.02, -0.02, 8)
    return _check(torch, h, rw, gu, d, go, 2, tol=3e-3, correction=corr, n_group=2, topk_group=1, rsf=1.5)


def _main():
    _interp.run_cases(CASES, globals(), torch)


# ----------------------------------------------------------------------------------------------- tests


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=600)


def _args(h, E=4, I=16, router_bias=None, **over):
    H = h.shape[1]
    a = dict(grad_out=torch.randn_like(h), grad_router_logits=None, hidden=h, router_weight=torch.randn(E, H),
             router_bias=router_bias, score_correction_bias=None, gate_up_proj=torch.randn(E, 2 * I, H),
             down_proj=torch.randn(E, H, I), top_k=2, scoring="softmax", norm_topk_prob=True, n_group=1,
             topk_group=1, routed_scaling_factor=1.0, router_dtype=None, activation="silu", ep_group_name=None,
             ep_world_size=1, ep_mode="all_to_all", weights_dtype=None, saved_up=torch.randn(0, 2 * I))
    a.update(over)
    return a


def test_gate_needs_env(monkeypatch):
    from kosmos.kernels import moe_ops

    args = tuple(_args(torch.randn(4, 32)).values())  # why_not takes the op's arguments but grads_needed
    for mode in (None, "forward", "0"):  # opt-in: off by default
        if mode is None:
            monkeypatch.delenv("KOSMOS_FUSED_MOE", raising=False)
        else:
            monkeypatch.setenv("KOSMOS_FUSED_MOE", mode)
        assert moe_ops.why_not_moe_layer_backward(*args).startswith("fused MoE backward is opt-in (KOSMOS_FUSED_MOE=1)")
    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    assert moe_ops.why_not_moe_layer_backward(*args) == "cpu tensors"


def test_backward_reasons():
    from kosmos.kernels.moe_backward import backward_reason

    h = torch.randn(4, 32)
    gu = torch.randn(4, 32, 32)
    assert backward_reason(torch.randn(4, 32), None, h, None, None, gu) is None
    assert "grad_out" in backward_reason(torch.randn(3, 32), None, h, None, None, gu)
    assert "grad_router_logits" in backward_reason(torch.randn(4, 32), torch.randn(4, 5), h, None, None, gu)
    assert "dtype" in backward_reason(torch.randn(4, 32).double(), None, h, None, None, gu)


def test_op_on_cpu_takes_reference_with_reason(monkeypatch):
    import kosmos  # noqa: F401  (registers the ops and the fused impls)
    from kosmos import reporting

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    reporting.reset()
    torch.ops.kosmos.moe_layer_backward(**_args(torch.randn(6, 32)))
    runs = reporting.report().runtime
    assert [k for k in runs if k[0] == "moe_layer_backward"] == [
        ("moe_layer_backward", "reference", "cpu tensors (fused kernels need CUDA)")], runs


if __name__ == "__main__":
    _main()
