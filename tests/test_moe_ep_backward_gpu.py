"""The expert-parallel fused MoE backward (kosmos.kernels.moe_ep_backward) in SimWorld: W in {2, 4, 8} simulated ranks
on one CUDA GPU (sm_90+), against the non-EP fused backward (kosmos.kernels.moe_backward, itself checked against the
reference in tests/test_moe_backward_gpu.py) run per rank on that rank's tokens with ALL experts: the same routing
code, so no near-tie can make the two disagree. Per rank, d_hidden / d_router_weight / d_router_bias must be
bit-identical (the same tiles, the same fixed orders); the local experts' d_gate_up_proj / d_down_proj must equal the
sum over ranks of the non-EP results' slices (one fp32 accumulation over all sources' rows, rounded once, against W
separately rounded partials summed in fp64: rel. error <= 1e-2 in bf16, 1e-5 in fp32). A sanity check against the
op's reference impl (kosmos.ops.moe.moe_layer_backward's math) runs on one case. Workspace data is poisoned (0xFF
bytes: NaN) before each run.
"""
from __future__ import annotations

import random

import pytest
import torch

from _moe_gpu import MARKS, exact_fp32, poison, rel_err, spin_bound, world, worlds  # noqa: F401  (autouse fixtures)

pytestmark = MARKS

from kosmos.kernels import runtime  # noqa: E402
from kosmos.kernels.runtime import SimWorld  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def make(W, T, H, I, E, dtype, seed=0, bias=False, glog=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(W, T, H, device="cuda", generator=g).to(dtype)
    rw = (torch.randn(E, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    d = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dtype)
    go = torch.randn(W, T, H, device="cuda", generator=g).to(dtype)
    rb = (torch.randn(E, device="cuda", generator=g) * 0.1).to(dtype) if bias else None
    gl = torch.randn(W, T, E, device="cuda", generator=g).to(dtype) if glog else None
    return h, rw, gu, d, go, rb, gl


def ep_backward(W, h, rw, gu, d, go, rb, gl, top_k, *, correction=None, scoring="softmax", n_group=1, topk_group=1,
                rsf=1.0, programs=None, straggler=None, drop_signal=None, sw=None):
    from kosmos.kernels.moe_ep_backward import moe_ep_backward

    sw = sw or world(W)
    E = rw.shape[0]
    return moe_ep_backward(sw.workspace, 0, go, gl, h, rw, rb, correction, gu.view(W, E // W, *gu.shape[1:]),
                           d.view(W, E // W, *d.shape[1:]), top_k, scoring, True, n_group, topk_group, rsf,
                           programs=programs, straggler=straggler, drop_signal=drop_signal)


def check(W, h, rw, gu, d, go, rb, gl, top_k, **kw):
    from kosmos.kernels.moe_backward import moe_backward

    sw = world(W)
    poison(sw)
    got = ep_backward(W, h, rw, gu, d, go, rb, gl, top_k, **kw)
    torch.cuda.synchronize()
    sw.workspace.check()
    E = rw.shape[0]
    E_loc = E // W
    sum_gu = torch.zeros(gu.shape, dtype=torch.float64, device="cuda")
    sum_d = torch.zeros(d.shape, dtype=torch.float64, device="cuda")
    router = dict(scoring=kw.get("scoring", "softmax"), n_group=kw.get("n_group", 1),
                  topk_group=kw.get("topk_group", 1), routed_scaling_factor=kw.get("rsf", 1.0))
    for r in range(W):
        ref = moe_backward(go[r], gl[r] if gl is not None else None, h[r], rw, rb, kw.get("correction"), gu, d, top_k,
                           norm_topk_prob=True, **router)
        assert torch.equal(got[0][r], ref[0]), f"rank {r}: d_hidden differs from the non-EP kernel"
        assert torch.equal(got[1][r], ref[1]), f"rank {r}: d_router_weight differs"
        if rb is not None:
            assert torch.equal(got[4][r], ref[4]), f"rank {r}: d_router_bias differs"
        sum_gu += ref[2].double()
        sum_d += ref[3].double()
    for q in range(W):
        sl = slice(q * E_loc, (q + 1) * E_loc)
        for name, a, b in (("d_gate_up_proj", got[2][q], sum_gu[sl]), ("d_down_proj", got[3][q], sum_d[sl])):
            assert torch.isfinite(a).all(), (q, name)
            nz = b.abs().sum() > 0
            err = rel_err(a, b) if nz else a.double().abs().max().item()
            assert err <= TOL[h.dtype], (q, name, err)
    return got


@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_routing(W, dtype):
    check(W, *make(W, 150, 256, 128, 32, dtype, seed=W), 4)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_deepseek_router_bias_glog(W):
    h, rw, gu, d, go, rb, gl = make(W, 130, 256, 128, 32, torch.bfloat16, seed=10 + W, bias=True, glog=True)
    corr = torch.randn(32, device="cuda") * 0.05
    check(W, h, rw, gu, d, go, rb, gl, 4, correction=corr, scoring="sigmoid", n_group=4, topk_group=2, rsf=2.5)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_hot_rank_empty_ranks(W):
    E = 32
    h, rw, gu, d, go, _, _ = make(W, 160, 256, 128, E, torch.bfloat16, seed=20 + W)
    bias = torch.zeros(E, device="cuda", dtype=torch.bfloat16)
    bias[E - E // W:] = 50.0  # every routed row of the group on the last rank
    got = check(W, h, rw, gu, d, go, bias, None, min(4, E // W))
    for q in range(W - 1):  # the other ranks' experts got no rows: exact zeros
        assert got[2][q].abs().max().item() == 0 and got[3][q].abs().max().item() == 0


@pytest.mark.parametrize("W", [2, 8])
def test_hot_expert_top1_tiny(W):
    h, rw, gu, d, go, _, _ = make(W, 7, 256, 128, 16, torch.bfloat16, seed=30 + W)
    bias = torch.zeros(16, device="cuda", dtype=torch.bfloat16)
    bias[3] = 50.0
    check(W, h, rw, gu, d, go, bias, None, 1)


def test_against_op_reference():
    """One case against the op's reference math (kosmos.ops.moe), fp32 exact: the chain of checks closes."""
    from kosmos.ops import moe_math as ops

    W = 4
    h, rw, gu, d, go, rb, _ = make(W, 64, 128, 64, 16, torch.float32, seed=40, bias=True)
    got = ep_backward(W, h, rw, gu, d, go, rb, None, 2)
    torch.cuda.synchronize()
    sum_gu = torch.zeros_like(gu, dtype=torch.float64)
    for r in range(W):
        _, ids, weights, _ = ops._route_forward(h[r], rw, rb, None, 2, "softmax", True, 1, 1, 1.0, None)
        d_x, d_w, d_gu, _ = ops.experts_backward(go[r], h[r], ids, weights, gu, d)
        sum_gu += d_gu.double()
    assert rel_err(got[2].reshape(gu.shape), sum_gu) <= 1e-5


@pytest.mark.parametrize("W", [2, 4])
def test_bit_identical_grids_and_straggler(W):
    args = make(W, 200, 256, 128, 32, torch.bfloat16, seed=50 + W, bias=True)
    sw = world(W)
    runs = []
    for programs, straggler in ((None, None), (5, (W - 1, 2_000_000)), (max(1, sw.default_programs() // 2),
                                                                        (0, 1_000_000))):
        poison(sw)
        runs.append(ep_backward(W, *args, 4, programs=programs, straggler=straggler))
    torch.cuda.synchronize()
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b), "reruns not bit-identical over grid size / straggler"


def test_missing_signal_raises():
    W = 2
    args = make(W, 64, 256, 128, 16, torch.bfloat16, seed=60)
    sw = SimWorld(W)
    n_tiles = 1  # T=64 in one 64-token tile: the DISPATCH of rank 1 is task n_tiles + 1
    runtime.set_spin_timeout(0.5)
    try:
        ep_backward(W, *args, 2, drop_signal=(1, n_tiles + 1), sw=sw)
        with pytest.raises(runtime.KernelTimeout, match="moe_layer_backward"):
            torch.cuda.synchronize()
            sw.workspace.check()
    finally:
        runtime.set_spin_timeout(20.0)


def test_cuda_graph_replay():
    W = 4
    h, rw, gu, d, go, rb, _ = make(W, 128, 256, 128, 32, torch.bfloat16, seed=70, bias=True)
    ep_backward(W, h, rw, gu, d, go, rb, None, 4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = ep_backward(W, h, rw, gu, d, go, rb, None, 4)
    for i in range(5):
        h.copy_(torch.randn_like(h))
        go.copy_(torch.randn_like(go))
        graph.replay()
        torch.cuda.synchronize()
        ref = ep_backward(W, h, rw, gu, d, go, rb, None, 4)
        torch.cuda.synchronize()
        for a, b in zip(grads, ref):
            assert torch.equal(a, b), f"replay {i} differs from an eager launch"
    world(W).workspace.check()


def test_randomized_launches_without_hang():
    rng = random.Random(1)
    for i in range(100):
        W = rng.choice([2, 4, 8])
        T = rng.randint(1, 200)
        h, rw, gu, d, go, _, _ = make(W, T, 256, 128, 32, torch.bfloat16, seed=2000 + i)
        bias = None
        if rng.random() < 0.3:
            bias = torch.zeros(32, device="cuda", dtype=torch.bfloat16)
            q = rng.randrange(W)
            bias[q * (32 // W): (q + 1) * (32 // W)] = rng.choice([2.0, 50.0])
        grads = ep_backward(W, h, rw, gu, d, go, bias, None, rng.choice([2, 4]),
                            programs=rng.choice([None, 3, max(1, world(W).default_programs() // 2)]))
        torch.cuda.synchronize()
        assert all(torch.isfinite(g).all() for g in grads)
    for sw in worlds():
        sw.workspace.check()
