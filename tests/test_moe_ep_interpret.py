"""The expert-parallel fused MoE kernels (kosmos.kernels.moe_ep forward, kosmos.kernels.moe_ep_backward) on the CPU
under TRITON_INTERPRET=1 with one simulated rank (W=1: the interpreter runs programs one after another, so a rank can
never wait for another rank there; W in {2, 4, 8} runs on the GPU, tests/test_moe_ep_gpu.py and
tests/test_moe_ep_backward_gpu.py). Still, W=1 runs every task of the protocol: counts published to itself, rows
dispatched into its receive region, the owner scan, expert tiles, results pushed back, the fold.

The ops layer's real-group entry (kosmos.kernels.moe_ops.run_moe_layer / run_moe_layer_backward through
kosmos.kernels.moe_ep_group) runs here too, on a one-rank workspace, against the op's fake impls' shapes.

Against the reference `route` + `experts` of kosmos.ops.moe; fp16 / fp32 only (the interpreter's tl.dot on bf16
multiplies raw bits). The cases run in subprocesses, one per core (tests/_interp.py; TRITON_INTERPRET must be set
before triton is imported).
"""
from __future__ import annotations

import _interp

CASES = ["softmax_top2_fp16", "softmax_top2_fp16_fp32_weights", "deepseek_router_fp32", "all_on_one_expert_top1", "counters_zeroed_epochs_advance",
         "missing_signal_raises", "backward_equals_non_ep_kernel_fp16", "backward_deepseek_fp32_glog",
         "backward_missing_signal_raises", "bad_arguments_raise", "growth_after_capture_keeps_old_tensors",
         "ops_layer_group_launch_matches_fake_impl", "group_blocks_same_bits"]


def _inputs(torch, T, H, I, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, T, H, generator=g).to(dtype)
    rw = (torch.randn(E, H, generator=g) * 0.5).to(dtype)
    gu = (torch.randn(1, E, 2 * I, H, generator=g) * 0.2).to(dtype)
    d = (torch.randn(1, E, H, I, generator=g) * 0.2).to(dtype)
    return h, rw, gu, d


def _check(torch, sw, h, rw, gu, d, top_k, tol, **kw):
    from kosmos.ops.moe_math import experts, route

    ref_kw = {k: kw[k] for k in ("router_bias", "score_correction_bias") if k in kw}
    scoring = kw.get("scoring", "softmax")
    logits, ids, w = route(h[0], rw, ref_kw.get("router_bias"), ref_kw.get("score_correction_bias"), top_k, scoring,
                           kw.get("norm_topk_prob", True), kw.get("n_group", 1), kw.get("topk_group", 1),
                           kw.get("routed_scaling_factor", 1.0), None, weights_dtype=kw.get("weights_dtype"))
    ref, counts = experts(h[0], ids, w, gu[0], d[0])
    runs = [sw.moe_layer(h, rw, ref_kw.get("router_bias"), ref_kw.get("score_correction_bias"), gu, d, top_k,
                         scoring, kw.get("norm_topk_prob", True), kw.get("n_group", 1), kw.get("topk_group", 1),
                         kw.get("routed_scaling_factor", 1.0), return_router_logits=True, return_routing=True,
                         programs=p, weights_dtype=kw.get("weights_dtype")) for p in (1, 3)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "grid sizes not bit-identical"
    out, lg, tpe, kid, kw_ = runs[0]
    assert torch.allclose(lg[0].float(), logits.float(), rtol=1e-3, atol=1e-3)
    assert torch.equal(kid[0].long().sort(1).values, ids.sort(1).values), "routing differs"
    assert torch.equal(tpe[0], counts), (tpe, counts)
    err = float((out[0].double() - ref.double()).norm() / ref.double().norm())
    assert err <= tol, err
    if kw.get("weights_dtype") == torch.float32:  # Mixtral's: the weights as the reference's, to a few fp32 ulps
        assert torch.equal(kid[0].long(), ids), "routing order differs"
        assert torch.allclose(kw_[0], w, rtol=1e-6, atol=0), (kw_[0] - w).abs().max()
        assert not torch.equal(kw_[0], kw_[0].half().float()), "weights rounded to fp16"
    return {"err": err, "counts": tpe[0].tolist()}


def case_softmax_top2_fp16(torch, SimWorld):
    h, rw, gu, d = _inputs(torch, 37, 32, 32, 8, torch.float16, 0)
    return _check(torch, SimWorld(1, device="cpu"), h, rw, gu, d, 2, 3e-3)


def case_softmax_top2_fp16_fp32_weights(torch, SimWorld):
    h, rw, gu, d = _inputs(torch, 29, 32, 32, 8, torch.float16, 5)
    return _check(torch, SimWorld(1, device="cpu"), h, rw, gu, d, 2, 3e-3, weights_dtype=torch.float32)


def case_deepseek_router_fp32(torch, SimWorld):
    h, rw, gu, d = _inputs(torch, 20, 32, 16, 16, torch.float32, 1)
    corr = torch.randn(16) * 0.1
    return _check(torch, SimWorld(1, device="cpu"), h, rw, gu, d, 4, 1e-5, score_correction_bias=corr,
                  scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)


def case_all_on_one_expert_top1(torch, SimWorld):
    h, rw, gu, d = _inputs(torch, 40, 32, 32, 8, torch.float16, 2)
    bias = torch.zeros(8, dtype=torch.float16)
    bias[5] = 60.0
    r = _check(torch, SimWorld(1, device="cpu"), h, rw, gu, d, 1, 3e-3, router_bias=bias)
    assert r["counts"] == [0, 0, 0, 0, 0, 40, 0, 0], r
    return r


def case_counters_zeroed_epochs_advance(torch, SimWorld):
    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 17, 32, 32, 8, torch.float16, 3)
    for i in range(3):
        sw.moe_layer(h, rw, None, None, gu, d, 2)
        assert sw.workspace.epochs() == [i + 1]
    lctl = sw.workspace.local_counters(1)
    assert int(lctl.abs().sum()) == 0, lctl
    ctrl = sw.workspace.buffers[0][:512].view(torch.int32)
    assert ctrl[0].item() == 0 and ctrl[1].item() == 0  # claim counter and done count reset
    from kosmos.reporting import report

    text = str(report())  # the explain report shows the workspace and the EP buffers' formula
    assert "moe_layer EP forward: counts 4*W*E + receive rows W*T*k*H*2" in text, text
    return {"epochs": sw.workspace.epochs()}


def case_missing_signal_raises(torch, SimWorld):
    from kosmos.kernels import runtime

    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 17, 32, 32, 8, torch.float16, 4)
    n_tiles = 2  # T=17 in tiles of the interpreter config's 16 tokens; the SCAN task is task n_tiles
    runtime.set_spin_timeout(0.0002)  # the interpreter counts one spin as 1 us: 200 spins, not 50000
    try:
        try:
            sw.moe_layer(h, rw, None, None, gu, d, 2, drop_signal=(0, n_tiles))
            sw.workspace.check()
        except runtime.KernelTimeout as e:
            msg = str(e)
        else:
            raise AssertionError("no KernelTimeout")
        assert "moe_layer" in msg and "rank 0" in msg, msg
        try:
            sw.moe_layer(h, rw, None, None, gu, d, 2)
        except runtime.WorkspaceBroken:
            pass
        else:
            raise AssertionError("a broken workspace took another call")
    finally:
        runtime.set_spin_timeout(None)
    return {"msg": msg}


def _backward_vs_non_ep(torch, SimWorld, dtype, top_k, seed, **kw):
    """At W=1 the EP backward runs the same tiles in the same orders as the non-EP fused backward (itself checked
    against the reference in test_moe_backward_interpret.py): every gradient must be bit-identical."""
    from kosmos.kernels.moe_backward import moe_backward

    h, rw, gu, d = _inputs(torch, 21, 32, 16, 8, dtype, seed)
    g = torch.Generator().manual_seed(seed + 100)
    go = torch.randn(1, 21, 32, generator=g).to(dtype)
    rb = (torch.randn(8, generator=g) * 0.1).to(dtype)
    glog = torch.randn(1, 21, 8, generator=g).to(dtype) if kw.pop("glog", False) else None
    sw = SimWorld(1, device="cpu")
    args = (rb, kw.pop("correction", None), gu, d, top_k, kw.get("scoring", "softmax"), True, kw.get("n_group", 1),
            kw.get("topk_group", 1), kw.get("rsf", 1.0))
    ref = moe_backward(go[0], glog[0] if glog is not None else None, h[0], rw, args[0], args[1], gu[0], d[0],
                       *args[4:], programs=1)
    for p in (1, 3):
        got = sw.moe_layer_backward(go, glog, h, rw, *args, programs=p)
        for name, a, b in zip(["d_hidden", "d_router_weight", "d_gate_up_proj", "d_down_proj", "d_router_bias"],
                              got, ref):
            assert torch.equal(a[0], b), f"{name} differs from the non-EP kernel (programs={p})"
    return {"epochs": sw.workspace.epochs()}


def case_backward_equals_non_ep_kernel_fp16(torch, SimWorld):
    return _backward_vs_non_ep(torch, SimWorld, torch.float16, 2, 5)


def case_backward_deepseek_fp32_glog(torch, SimWorld):
    return _backward_vs_non_ep(torch, SimWorld, torch.float32, 4, 6, correction=torch.randn(8) * 0.1,
                               scoring="sigmoid", n_group=2, topk_group=1, rsf=2.5, glog=True)


def case_backward_missing_signal_raises(torch, SimWorld):
    """Rank 0's first DISPATCH task raises no rows flag: UP waits past the bound; the error names the backward."""
    from kosmos.kernels import runtime

    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 17, 32, 32, 8, torch.float16, 7)
    n_tiles = 2  # T=17 in the interpreter config's 16-token tiles: DISPATCH tasks are n_tiles + 1 ...
    runtime.set_spin_timeout(0.0002)  # the interpreter counts one spin as 1 us: 200 spins, not 50000
    try:
        try:
            sw.moe_layer_backward(torch.randn_like(h), None, h, rw, None, None, gu, d, 2,
                                  drop_signal=(0, n_tiles + 2))
            sw.workspace.check()
        except runtime.KernelTimeout as e:
            msg = str(e)
        else:
            raise AssertionError("no KernelTimeout")
    finally:
        runtime.set_spin_timeout(None)
    assert "kosmos::moe_layer_backward" in msg, msg
    return {"msg": msg}


def case_bad_arguments_raise(torch, SimWorld):
    import dataclasses

    from kosmos.kernels import moe

    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 8, 32, 32, 8, torch.float16, 8)
    bad = {"top_k > E": lambda: sw.moe_layer(h, rw, None, None, gu, d, 9),
           "gate_up_proj of another rank count": lambda: sw.moe_layer(h, rw, None, None, gu.expand(2, -1, -1, -1),
                                                                      d, 2),
           "router_bias shape": lambda: sw.moe_layer(h, rw, torch.zeros(3, dtype=h.dtype), None, gu, d, 2),
           "n_group not dividing E": lambda: sw.moe_layer(h, rw, None, None, gu, d, 2, "sigmoid", True, 3, 1),
           "grad_router_logits of another rank count": lambda: sw.moe_layer_backward(
               torch.randn_like(h), torch.zeros(2, 8, 8, dtype=h.dtype), h, rw, None, None, gu, d, 2),
           "fold_groups the EP kernel does not run": lambda: sw.moe_layer(
               h, rw, None, None, gu, d, 2, config=dataclasses.replace(moe.CONFIGS["interpret"], fold_groups=2)),
           "router_gemm the EP kernel does not run": lambda: sw.moe_layer(
               h, rw, None, None, gu, d, 2, config=dataclasses.replace(moe.CONFIGS["interpret"], router_gemm=1)),
           "joint_gate_up the EP kernel does not run": lambda: sw.moe_layer(
               h, rw, None, None, gu, d, 2, config=dataclasses.replace(moe.CONFIGS["interpret"], joint_gate_up=True)),
           "group_blocks 0": lambda: sw.moe_layer(
               h, rw, None, None, gu, d, 2, config=dataclasses.replace(moe.CONFIGS["interpret"], group_blocks=0))}
    for name, call in bad.items():
        try:
            call()
        except ValueError as e:
            assert "EP kernel" in str(e) or "kernel does not run" not in name, (name, e)
            continue
        raise AssertionError(f"{name}: no ValueError")
    return {"checked": len(bad)}


def case_group_blocks_same_bits(torch, SimWorld):
    """UP / DOWN tasks G blocks at a time, chunk by chunk (group_blocks): the same bits as block by block, on 1 and 3
    programs; 70 tokens top-2 over 4 experts in 16-row blocks (~3 blocks per expert), I = 48 and H = 64 over 3 and 2
    chunks. The workspace's data is NaN before each run, so a combine row the run does not write shows."""
    import dataclasses

    from kosmos.kernels import moe

    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 70, 64, 48, 4, torch.float16, 9)
    base = moe.CONFIGS["interpret"]
    ref = sw.moe_layer(h, rw, None, None, gu, d, 2, return_routing=True, programs=1, config=base)
    off = sw.workspace.layout.data_off
    for g in (2, 8):
        for p in (1, 3):
            for buf in sw.workspace.buffers:  # NaN rows: a row this run does not write shows (not the last run's)
                buf[off:].fill_(0xFF)
            run = sw.moe_layer(h, rw, None, None, gu, d, 2, return_routing=True, programs=p,
                               config=dataclasses.replace(base, group_blocks=g))
            assert all(torch.equal(a, b) for a, b in zip(ref, run)), f"group_blocks={g} programs={p} differs"
    assert torch.isfinite(ref[0]).all()
    return {"counts": ref[2][0].tolist()}


def case_growth_after_capture_keeps_old_tensors(torch, SimWorld):
    """After a launch under CUDA graph capture (marked by hand here: the CPU has no graphs), tensors a later call
    replaces stay allocated, since the graph replays on their addresses."""
    ws = SimWorld(1, device="cpu").workspace
    ws.local_counters(8)
    old_buffers, old_counters = ws.buffers, ws.local_counters(8)
    ws.captured = True
    ws.ensure(ws.layout.flag_words * 4, ws.layout.data_bytes * 4)
    ws.local_counters(old_counters.shape[1] * 4)
    assert ws.buffers is not old_buffers and ws.local_counters(8) is not old_counters
    kept = [t for item in ws._retired for t in (item if isinstance(item, tuple) else (item,))]
    assert any(t is old_buffers for t in kept) and any(t is old_counters for t in kept), kept
    return {"retired": len(ws._retired)}



def case_ops_layer_group_launch_matches_fake_impl(torch, SimWorld):
    """What kosmos::moe_layer's fused impls return with an EP group (kosmos.kernels.moe_ops.run_moe_layer /
    run_moe_layer_backward through kosmos.kernels.moe_ep_group; the group's workspace replaced by a one-rank
    SimWorld's): the op's fake impls' shapes and dtypes (saved_up empty), the same values as SimWorld's launch."""
    import kosmos.kernels.moe_ep_group as group_launch
    from kosmos.kernels import moe_ops
    from kosmos.ops import moe as ops

    sw = SimWorld(1, device="cpu")
    h, rw, gu, d = _inputs(torch, 19, 32, 32, 8, torch.float16, 9)
    go = torch.randn_like(h)
    args = (h[0], rw, None, None, gu[0], d[0], 2, "softmax", True, 1, 1, 1.0, None, "silu", True, "g", 1, "all_to_all")
    bargs = (go[0], None, h[0], rw, None, None, gu[0], d[0], 2, "softmax", True, 1, 1, 1.0, None, "silu", "g", 1,
             "all_to_all", None)  # (None: weights_dtype)
    workspace = group_launch._workspace
    group_launch._workspace = lambda group_name, device, ws, rank: (sw.workspace, 0)
    try:
        got = moe_ops.run_moe_layer(*args)
        got_b = list(ops._backward_outputs(moe_ops.run_moe_layer_backward(*bargs, got[3]), rw))  # as the op returns
    finally:
        group_launch._workspace = workspace
    fake = ops._moe_layer_fake(*args)
    fake_b = list(ops._moe_layer_backward_fake(*bargs, None, got[3]))  # (None: grads_needed, all)
    for a, b in zip(list(got) + got_b, list(fake) + fake_b):
        assert (tuple(a.shape), a.dtype) == (tuple(b.shape), b.dtype), (tuple(a.shape), a.dtype, tuple(b.shape))
    assert len(got) == len(fake) and len(got_b) == len(fake_b) and got[3].shape == (0, 64)
    want = sw.moe_layer(h, rw, None, None, gu, d, 2, return_router_logits=True, programs=1)
    want_b = sw.moe_layer_backward(go, None, h, rw, None, None, gu, d, 2, programs=1)
    assert all(torch.equal(a, b[0]) for a, b in zip(list(got[:3]) + got_b, list(want) + want_b))
    return {"outputs": len(got) + len(got_b)}

def _main():
    import torch

    from kosmos.kernels.runtime import SimWorld

    _interp.run_cases(CASES, globals(), torch, SimWorld)


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=900)


if __name__ == "__main__":
    _main()
