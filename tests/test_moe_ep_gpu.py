"""The expert-parallel fused MoE forward (kosmos.kernels.moe_ep) in SimWorld: W in {2, 4, 8} simulated ranks on one
CUDA GPU (sm_90+) running the real kernel, against the unsharded reference (`route` + `experts` of kosmos.ops.moe
with every rank's experts concatenated) for each rank's tokens.

The expert outputs are compared with the reference run on the KERNEL's routing (returned with return_routing=True):
bf16 near-ties between two experts' scores may resolve differently under another accumulation order; the routing
itself is compared separately. Before each run the workspaces' data (count slots, receive and combine rows) are
poisoned with 0xFF bytes (NaN in every float dtype), so a row the kernel forgets to move shows up as NaN.
"""
from __future__ import annotations

import random

import pytest
import torch

from _moe_gpu import MARKS, exact_fp32, poison, rel_err, spin_bound, world, worlds  # noqa: F401  (autouse fixtures)

pytestmark = MARKS

from kosmos.kernels import runtime  # noqa: E402
from kosmos.kernels.runtime import SimWorld  # noqa: E402
from kosmos.ops.moe_math import experts, route  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def make(W, T, H, I, E, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(W, T, H, device="cuda", generator=g).to(dtype)
    rw = (torch.randn(E, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    d = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dtype)
    return h, rw, gu, d


def shard(w: torch.Tensor, W: int) -> torch.Tensor:
    return w.view(W, w.shape[0] // W, *w.shape[1:])


def run_and_check(W, h, rw, gu, d, top_k, *, router_bias=None, correction=None, scoring="softmax", n_group=1,
                  topk_group=1, rsf=1.0, programs=None, straggler=None, max_flipped_rows=2, weights_dtype=None):
    sw = world(W)
    poison(sw)
    out, lg, tpe, kid, kw = sw.moe_layer(h, rw, router_bias, correction, shard(gu, W), shard(d, W), top_k, scoring,
                                         True, n_group, topk_group, rsf, return_router_logits=True,
                                         return_routing=True, programs=programs, straggler=straggler,
                                         weights_dtype=weights_dtype)
    torch.cuda.synchronize()
    sw.workspace.check()
    E = rw.shape[0]
    total = torch.zeros(E, dtype=torch.int32, device="cuda")
    for r in range(W):
        logits, ids, w = route(h[r], rw, router_bias, correction, top_k, scoring, True, n_group, topk_group, rsf, None)
        assert torch.allclose(lg[r].float(), logits.float(), rtol=2e-2, atol=2e-2)
        flipped = (kid[r].long().sort(1).values != ids.sort(1).values).any(1).sum().item()
        assert flipped <= max_flipped_rows, f"rank {r}: routing differs on {flipped} rows"
        ref, counts = experts(h[r], kid[r].long(), kw[r].to(weights_dtype or lg.dtype), gu, d)
        total += counts
        assert torch.isfinite(out[r]).all(), f"rank {r}: NaN/inf in the output (a row not moved?)"
        err = rel_err(out[r], ref)
        assert err <= TOL[h.dtype], f"rank {r}: rel. error {err}"
    for r in range(W):
        assert torch.equal(tpe[r], total), (r, tpe[r], total)
    return out, tpe


@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_routing(W, dtype):
    h, rw, gu, d = make(W, 333, 256, 128, 32, dtype, seed=W)
    run_and_check(W, h, rw, gu, d, 4)


@pytest.mark.parametrize("W", [2, 8])
def test_mixtral_fp32_weights_on_bf16(W):
    """Mixtral's router under EP: the fp32 softmax values stay the weights (weights_dtype), the fold's products fp32;
    the output is the reference experts' with the kernel's fp32 weights, which are not bf16 values."""
    h, rw, gu, d = make(W, 300, 256, 128, 8, torch.bfloat16, seed=20 + W)
    run_and_check(W, h, rw, gu, d, 2, weights_dtype=torch.float32)
    kw = world(W).moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), 2, return_routing=True,
                            weights_dtype=torch.float32)[-1]
    assert kw.dtype == torch.float32 and not torch.equal(kw, kw.bfloat16().float())


@pytest.mark.parametrize("W", [2, 4])
def test_group_blocks_bit_identical(W):
    """UP / DOWN tasks G blocks at a time (MoeConfig.group_blocks, on by default for experts far beyond the L2): the
    same bits as block by block, on every rank, the workspaces poisoned before each run."""
    import dataclasses

    from kosmos.kernels import moe

    h, rw, gu, d = make(W, 700, 256, 128, 16, torch.bfloat16, seed=30 + W)
    sw = world(W)
    base = dataclasses.replace(moe.select_config(h[0], gu, num_experts=16), group_blocks=1)
    runs = []
    for g in (1, 4, 8):
        poison(sw)
        runs.append(sw.moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), 4, return_routing=True,
                                 config=dataclasses.replace(base, group_blocks=g)))
    assert torch.isfinite(runs[0][0]).all()
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_deepseek_router(W):
    h, rw, gu, d = make(W, 200, 256, 128, 32, torch.bfloat16, seed=10 + W)
    corr = torch.randn(32, device="cuda") * 0.05
    run_and_check(W, h, rw, gu, d, 4, correction=corr, scoring="sigmoid", n_group=4, topk_group=2, rsf=2.5)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_hot_expert(W):
    h, rw, gu, d = make(W, 300, 256, 128, 32, torch.bfloat16, seed=20 + W)
    bias = torch.zeros(32, device="cuda", dtype=torch.bfloat16)
    bias[7] = 50.0  # every token picks expert 7 (+ 3 others)
    _, tpe = run_and_check(W, h, rw, gu, d, 4, router_bias=bias)
    assert tpe[0, 7].item() == W * 300


@pytest.mark.parametrize("W", [2, 4, 8])
def test_hot_rank_empty_ranks(W):
    """All routed rows of the group on the last rank (its receive region at the worst case); the other ranks'
    experts get nothing."""
    E = 32
    h, rw, gu, d = make(W, 257, 256, 128, E, torch.bfloat16, seed=30 + W)
    bias = torch.zeros(E, device="cuda", dtype=torch.bfloat16)
    bias[E - E // W:] = 50.0
    _, tpe = run_and_check(W, h, rw, gu, d, min(4, E // W), router_bias=bias)
    assert tpe[0, : E - E // W].sum().item() == 0
    assert tpe[0].sum().item() == W * 257 * min(4, E // W)


@pytest.mark.parametrize("W", [2, 8])
def test_top1_ragged_tiny(W):
    h, rw, gu, d = make(W, 5, 256, 128, 16, torch.bfloat16, seed=40 + W)
    run_and_check(W, h, rw, gu, d, 1)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_bit_identical_grids_and_straggler(W):
    h, rw, gu, d = make(W, 500, 256, 128, 32, torch.bfloat16, seed=50 + W)
    sw = world(W)
    full = sw.default_programs()
    runs = []
    for programs, straggler in ((None, None), (7, (W - 1, 2_000_000)), (max(1, full // 2), (0, 1_000_000))):
        poison(sw)
        runs.append(sw.moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), 4, programs=programs,
                                 straggler=straggler))
    torch.cuda.synchronize()
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b), "reruns not bit-identical over grid size / straggler"


@pytest.mark.parametrize("W", [2, 4])
def test_missing_signal_raises(W):
    """Rank 1's SCAN task publishes no counts: every owner's OWNER_SCAN waits past the bound -> KernelTimeout."""
    h, rw, gu, d = make(W, 64, 256, 128, 16, torch.bfloat16, seed=60 + W)
    sw = SimWorld(W)  # its own workspace: it ends broken
    cfg_bt = 64  # moe.select_config's token tile for bf16 with <= 128 experts
    n_tiles = -(-64 // cfg_bt)
    runtime.set_spin_timeout(0.5)
    try:
        sw.moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), 2, drop_signal=(1, n_tiles))
        with pytest.raises(runtime.KernelTimeout, match="moe_layer"):
            torch.cuda.synchronize()
            sw.workspace.check()
        with pytest.raises(runtime.WorkspaceBroken):
            sw.moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), 2)
    finally:
        runtime.set_spin_timeout(20.0)


def test_cuda_graph_replay():
    W = 4
    h, rw, gu, d = make(W, 256, 256, 128, 32, torch.bfloat16, seed=70)
    sw = world(W)
    gus, ds = shard(gu, W), shard(d, W)
    sw.moe_layer(h, rw, None, None, gus, ds, 4)  # sizes the workspace and counters before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, tpe = sw.moe_layer(h, rw, None, None, gus, ds, 4)
    for i in range(10):
        h.copy_(torch.randn_like(h))
        graph.replay()
        torch.cuda.synchronize()
        ref, _, ref_tpe = sw.moe_layer(h, rw, None, None, gus, ds, 4)
        torch.cuda.synchronize()
        assert torch.equal(out, ref) and torch.equal(tpe, ref_tpe), f"replay {i} differs from an eager launch"
    sw.workspace.check()


def test_randomized_launches_without_hang():
    rng = random.Random(0)
    checked = 0
    for i in range(300):
        W = rng.choice([2, 4, 8])
        T = rng.randint(1, 300)
        top_k = rng.choice([1, 2, 4])
        h, rw, gu, d = make(W, T, 256, 128, 32, torch.bfloat16, seed=1000 + i)
        bias = None
        if rng.random() < 0.3:  # skew the routing towards a random rank's experts
            bias = torch.zeros(32, device="cuda", dtype=torch.bfloat16)
            q = rng.randrange(W)
            bias[q * (32 // W): (q + 1) * (32 // W)] = rng.choice([2.0, 50.0])
        sw = world(W)
        programs = rng.choice([None, 3, max(1, sw.default_programs() // 2)])
        if i % 30 == 0:
            run_and_check(W, h, rw, gu, d, top_k, router_bias=bias, programs=programs)
            checked += 1
        else:
            out, _, tpe = sw.moe_layer(h, rw, bias, None, shard(gu, W), shard(d, W), top_k, programs=programs)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all() and int(tpe[0].sum()) == W * T * top_k
    for sw in worlds():
        sw.workspace.check()
    assert checked == 10


def test_workspace_bytes_formula():
    from kosmos.kernels.moe_ep import ep_workspace_bytes

    W, T, H, I, E, k = 4, 100, 256, 128, 32, 4
    h, rw, gu, d = make(W, T, H, I, E, torch.bfloat16, seed=80)
    sw = SimWorld(W)
    sw.moe_layer(h, rw, None, None, shard(gu, W), shard(d, W), k)
    need = ep_workspace_bytes(W, E, T, k, H, 2, 2)
    assert need == 512 + W * T * k * H * 2 + -(-T * k * H * 2 // 512) * 512
    assert sw.workspace.layout.data_bytes >= need
