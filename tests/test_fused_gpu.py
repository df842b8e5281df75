"""Fused AG+GEMM and GEMM+RS kernels on one CUDA GPU (sm_90+): SimWorld with W in {1, 2, 4, 8} simulated
ranks running the real kernels, against float32 torch references on the same inputs.

Covers: ragged shapes (M, N, K not multiples of the tile, 16-byte aligned rows), several weights / (input,
weight) pairs, bias, outputs poisoned with NaN before each run, bit-identical reruns over grid sizes,
lookahead and straggler position (a rank delayed inside the kernel), a missing signal raising KernelTimeout
within the bound, a CUDA graph captured once and replayed 100 times on changing inputs, 500 randomized
launches without a hang, peak memory, the logged fallback for unaligned shapes, and the ops/backend on a
size-1 NCCL group (the fused kernel runs; kosmos.report() says so). Gathers / scatters along dim 1 (local
batch B >= 2, kernel row remap) at every W, their bitwise reruns, and their reference fallback with a reason.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU with TMA (sm_90+)"),
]

from kosmos.kernels import ag_gemm, gemm_rs, queue, runtime  # noqa: E402
from kosmos.kernels.runtime import KernelTimeout, SimWorld, WorkspaceBroken  # noqa: E402

WORLDS = [1, 2, 4, 8]
TOL = 1e-2
# (m rows per rank, K, [N_i]): ragged against the 128x256x64 tile; rows 16-byte aligned for bf16
AG_SHAPES = [(200, 256, [264, 40]), (136, 520, [520, 104]), (64, 128, [256, 8])]
# (M rows per rank before the scatter / W, [K_i], N)
RS_SHAPES = [(72, [256], 264), (136, [200, 64], 520), (40, [128], 8)]


@pytest.fixture(autouse=True, scope="module")
def _spin_bound():
    runtime.set_spin_timeout(20.0)  # a hang raises in 20 s instead of 300
    yield
    runtime.set_spin_timeout(None)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def ag_inputs(W, m, K, Ns, seed, trans=True, bias_on=(True,), dtype=torch.bfloat16):
    g = _gen(seed)
    a = torch.randn(W, m, K, device="cuda", generator=g).to(dtype)
    if trans:  # Linear weights [N, K] used as w.t(), the usual layout
        ws = [torch.randn(W, n, K, device="cuda", generator=g).to(dtype).transpose(1, 2) for n in Ns]
    else:
        ws = [torch.randn(W, K, n, device="cuda", generator=g).to(dtype) for n in Ns]
    bs = [torch.randn(W, n, device="cuda", generator=g).to(dtype) if (i < len(bias_on) and bias_on[i]) else None
          for i, n in enumerate(Ns)]
    return a, ws, bs


def ag_reference(a, ws, bs):
    W, m, K = a.shape
    gathered = a.reshape(W * m, K).float()
    return [torch.stack([gathered @ w[r].float() + (b[r].float() if b is not None else 0) for r in range(W)])
            for w, b in zip(ws, bs)]


def run_ag(sw, a, ws, bs, **kw):
    W, m, K = a.shape
    outs = [torch.full((W, W * m, w.shape[2]), float("nan"), device="cuda", dtype=a.dtype) for w in ws]
    g = torch.full((W, W * m, K), float("nan"), device="cuda", dtype=a.dtype)
    res = sw.ag_gemm(a, ws, bs, return_gathered=True, outs=outs, gathered=g, **kw)
    torch.cuda.synchronize()
    for o in res:
        assert not o.isnan().any(), "output not fully written (NaN poison left)"
    return res


def rs_inputs(W, mo, Ks, N, seed, bias=True, dtype=torch.bfloat16):
    g = _gen(seed)
    M = W * mo
    xs = [torch.randn(W, M, k, device="cuda", generator=g).to(dtype) for k in Ks]
    ws = [torch.randn(W, N, k, device="cuda", generator=g).to(dtype).transpose(1, 2) for k in Ks]
    b = torch.randn(W, N, device="cuda", generator=g).to(dtype) if bias else None
    return xs, ws, b


def rs_reference(xs, ws, b, op):
    W, M, _ = xs[0].shape
    full = torch.stack([sum(x[q].float() @ w[q].float() for x, w in zip(xs, ws)) + (b[q].float() if b is not None else 0)
                        for q in range(W)])
    red = full.sum(0) if op == "sum" else full.mean(0)
    return red.reshape(W, M // W, -1)


def run_rs(sw, xs, ws, b, op, **kw):
    W, M, _ = xs[0].shape
    out = torch.full((W, M // W, ws[0].shape[2]), float("nan"), device="cuda", dtype=xs[0].dtype)
    res = sw.gemm_rs(xs, ws, b, op, out=out, **kw)
    torch.cuda.synchronize()
    assert not res.isnan().any(), "output not fully written (NaN poison left)"
    return res


# ------------------------------------------------------------------------------------------------ AG+GEMM


@pytest.mark.parametrize("W", WORLDS)
def test_ag_gemm_simworld(W):
    sw = SimWorld(W)
    for i, (m, K, Ns) in enumerate(AG_SHAPES):
        a, ws, bs = ag_inputs(W, m, K, Ns, seed=10 * W + i, bias_on=(True, False))
        res = run_ag(sw, a, ws, bs)
        refs = ag_reference(a, ws, bs)
        for j, (o, ref) in enumerate(zip(res[:-1], refs)):
            err = rel_err(o, ref)
            assert err <= TOL, (W, m, K, Ns, j, err)
        want_g = a.reshape(W * m, K).expand(W, W * m, K)
        assert torch.equal(res[-1], want_g), "gathered buffer differs from the concatenated shards"


@pytest.mark.parametrize("W", [1, 8])
def test_ag_gemm_store_epilogue(W):
    """The plain-store epilogue (epilogue="store"; timed no faster than the TMA one, RESULTS.md) computes the same bits."""
    sw = SimWorld(W)
    for i, (m, K, Ns) in enumerate(AG_SHAPES[:2]):
        a, ws, bs = ag_inputs(W, m, K, Ns, seed=60 + i, bias_on=(True, False))
        tma = run_ag(sw, a, ws, bs)
        st = run_ag(sw, a, ws, bs, epilogue="store")
        for x, y in zip(tma, st):
            assert torch.equal(x, y)


def test_ag_gemm_row_major_fp16_three_weights():
    W = 2
    a, ws, bs = ag_inputs(W, 200, 256, [264, 40, 72], seed=3, trans=False, bias_on=(False, True, True),
                          dtype=torch.float16)
    res = run_ag(SimWorld(W), a, ws, bs)
    for o, ref in zip(res[:-1], ag_reference(a, ws, bs)):
        assert rel_err(o, ref) <= TOL


@pytest.mark.parametrize("W", [2, 8])
def test_ag_gemm_rerun_bitwise(W):
    sw = SimWorld(W)
    a, ws, bs = ag_inputs(W, 200, 256, [264, 40], seed=7, bias_on=(True, False))
    base = run_ag(sw, a, ws, bs)
    variants = [dict(programs=3), dict(programs=1, lookahead=0),
                dict(straggler=(W - 1, 300_000)), dict(programs=5, straggler=(0, 500_000), lookahead=2)]
    for kw in variants:
        again = run_ag(sw, a, ws, bs, **kw)
        for x, y in zip(base, again):
            assert torch.equal(x, y), f"rerun with {kw} not bit-identical"


# ------------------------------------------------------------------------------------------------ GEMM+RS


@pytest.mark.parametrize("W", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gemm_rs_simworld(W, op):
    sw = SimWorld(W)
    for i, (mo, Ks, N) in enumerate(RS_SHAPES):
        xs, ws, b = rs_inputs(W, mo, Ks, N, seed=100 + 10 * W + i, bias=(i != 2))
        out = run_rs(sw, xs, ws, b, op)
        err = rel_err(out, rs_reference(xs, ws, b, op))
        assert err <= TOL, (W, op, mo, Ks, N, err)


@pytest.mark.parametrize("W", [2, 8])
def test_gemm_rs_rerun_bitwise(W):
    sw = SimWorld(W)
    xs, ws, b = rs_inputs(W, 136, [256], 520, seed=11)
    base = run_rs(sw, xs, ws, b, "sum")
    for kw in [dict(programs=2), dict(straggler=(W - 1, 400_000)), dict(programs=7, straggler=(0, 300_000))]:
        assert torch.equal(base, run_rs(sw, xs, ws, b, "sum", **kw)), f"rerun with {kw} not bit-identical"


# ---------------------------------------------------------------------------------------------- gather / scatter dim 1

# TP+SP with local batch B >= 2: shards [B, s, K] gathered along dim 1 (kernel row remap). s a multiple of
# the tile: 128 (the config's BLOCK_M) or 64 (the smaller tile); N, K ragged against 128x256x64.
AG_DIM1_SHAPES = [(2, 128, 520, [264, 40]), (3, 64, 256, [520]), (2, 192, 136, [104, 8, 72])]
# (B, s_out = rows per rank per batch entry after the scatter, [K_i], N)
RS_DIM1_SHAPES = [(2, 128, [520], 264), (3, 64, [200, 64], 520), (2, 64, [136], 8)]


def ag_dim1_inputs(W, B, s, K, Ns, seed, bias_on=(True,), dtype=torch.bfloat16):
    g = _gen(seed)
    a = torch.randn(W, B, s, K, device="cuda", generator=g).to(dtype)
    ws = [torch.randn(W, n, K, device="cuda", generator=g).to(dtype).transpose(1, 2) for n in Ns]
    bs = [torch.randn(W, n, device="cuda", generator=g).to(dtype) if (i < len(bias_on) and bias_on[i]) else None
          for i, n in enumerate(Ns)]
    return a, ws, bs


def ag_dim1_reference(a, ws, bs):
    """kosmos::ag_gemm semantics in torch: cat of the ranks' shards along dim 1, matmul, per rank's weight."""
    W = a.shape[0]
    gathered = torch.cat([a[r] for r in range(W)], dim=1).float()  # [B, W*s, K]
    return gathered, [torch.stack([gathered @ w[r].float() + (b[r].float() if b is not None else 0)
                                   for r in range(W)]) for w, b in zip(ws, bs)]


def run_ag_dim1(sw, a, ws, bs, **kw):
    from kosmos.kernels.ag_gemm import ag_gemm_sim

    W, B, s, K = a.shape
    outs = [torch.full((W, B, W * s, w.shape[2]), float("nan"), device="cuda", dtype=a.dtype) for w in ws]
    g = torch.full((W, B, W * s, K), float("nan"), device="cuda", dtype=a.dtype)
    res = ag_gemm_sim(sw, a, ws, bs, return_gathered=True, outs=outs, gathered=g, gather_dim=1, **kw)
    torch.cuda.synchronize()
    for o in res:
        assert not o.isnan().any(), "output not fully written (NaN poison left)"
    return res


def rs_dim1_inputs(W, B, so, Ks, N, seed, bias=True, dtype=torch.bfloat16):
    g = _gen(seed)
    xs = [torch.randn(W, B, W * so, k, device="cuda", generator=g).to(dtype) for k in Ks]
    ws = [torch.randn(W, N, k, device="cuda", generator=g).to(dtype).transpose(1, 2) for k in Ks]
    b = torch.randn(W, N, device="cuda", generator=g).to(dtype) if bias else None
    return xs, ws, b


def rs_dim1_reference(xs, ws, b, op):
    """kosmos::gemm_rs semantics in torch: each simulated rank's full product, reduced over ranks, chunk r
    along dim 1 for rank r."""
    W = xs[0].shape[0]
    full = torch.stack([sum(x[q].float() @ w[q].float() for x, w in zip(xs, ws))
                        + (b[q].float() if b is not None else 0) for q in range(W)])  # [W, B, S, N]
    red = full.sum(0) if op == "sum" else full.mean(0)
    return torch.stack(list(red.chunk(W, dim=1)))  # [W, B, S/W, N]


def run_rs_dim1(sw, xs, ws, b, op, **kw):
    from kosmos.kernels.gemm_rs import gemm_rs_sim

    W, B, S, _ = xs[0].shape
    out = torch.full((W, B, S // W, ws[0].shape[2]), float("nan"), device="cuda", dtype=xs[0].dtype)
    res = gemm_rs_sim(sw, xs, ws, b, op, out=out, scatter_dim=1, **kw)
    torch.cuda.synchronize()
    assert res.shape == out.shape
    assert not res.isnan().any(), "output not fully written (NaN poison left)"
    return res


@pytest.mark.parametrize("W", WORLDS)
def test_ag_gemm_gather_dim1(W):
    sw = SimWorld(W)
    for i, (B, s, K, Ns) in enumerate(AG_DIM1_SHAPES):
        a, ws, bs = ag_dim1_inputs(W, B, s, K, Ns, seed=200 + 10 * W + i, bias_on=(True, False, True))
        res = run_ag_dim1(sw, a, ws, bs)
        gathered, refs = ag_dim1_reference(a, ws, bs)
        for j, (o, ref) in enumerate(zip(res[:-1], refs)):
            assert o.shape == ref.shape, (o.shape, ref.shape)
            err = rel_err(o, ref)
            assert err <= TOL, (W, B, s, K, Ns, j, err)
        assert torch.equal(res[-1], gathered.to(a.dtype).expand(W, *gathered.shape)), "gathered buffer"


@pytest.mark.parametrize("W", [1, 4])
def test_ag_gemm_gather_dim1_store_epilogue(W):
    sw = SimWorld(W)
    for i, (B, s, K, Ns) in enumerate(AG_DIM1_SHAPES[:2]):
        a, ws, bs = ag_dim1_inputs(W, B, s, K, Ns, seed=260 + i)
        tma = run_ag_dim1(sw, a, ws, bs)
        st = run_ag_dim1(sw, a, ws, bs, epilogue="store")
        for x, y in zip(tma, st):
            assert torch.equal(x, y)


@pytest.mark.parametrize("W", [2, 8])
def test_ag_gemm_gather_dim1_rerun_bitwise(W):
    sw = SimWorld(W)
    for B, s, K, Ns in AG_DIM1_SHAPES[:2]:
        a, ws, bs = ag_dim1_inputs(W, B, s, K, Ns, seed=270, bias_on=(True, False))
        base = run_ag_dim1(sw, a, ws, bs)
        for kw in [dict(programs=3), dict(programs=1, lookahead=0), dict(programs=5, straggler=(0, 300_000))]:
            again = run_ag_dim1(sw, a, ws, bs, **kw)
            for x, y in zip(base, again):
                assert torch.equal(x, y), f"rerun with {kw} not bit-identical"


@pytest.mark.parametrize("W", WORLDS)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gemm_rs_scatter_dim1(W, op):
    sw = SimWorld(W)
    for i, (B, so, Ks, N) in enumerate(RS_DIM1_SHAPES):
        xs, ws, b = rs_dim1_inputs(W, B, so, Ks, N, seed=300 + 10 * W + i, bias=(i != 2))
        out = run_rs_dim1(sw, xs, ws, b, op)
        ref = rs_dim1_reference(xs, ws, b, op)
        assert out.shape == ref.shape, (out.shape, ref.shape)
        err = rel_err(out, ref)
        assert err <= TOL, (W, op, B, so, Ks, N, err)


@pytest.mark.parametrize("W", [2, 8])
def test_gemm_rs_scatter_dim1_rerun_bitwise(W):
    sw = SimWorld(W)
    for B, so, Ks, N in RS_DIM1_SHAPES[:2]:
        xs, ws, b = rs_dim1_inputs(W, B, so, Ks, N, seed=311)
        base = run_rs_dim1(sw, xs, ws, b, "sum")
        for kw in [dict(programs=2), dict(programs=7, straggler=(0, 300_000))]:
            assert torch.equal(base, run_rs_dim1(sw, xs, ws, b, "sum", **kw)), f"rerun with {kw} not bit-identical"


def test_dim1_untiled_rows_rejected_by_launcher():
    """s not a multiple of 64 rows: the launcher refuses (fused_ops sends such calls to the reference path)."""
    sw = SimWorld(2)
    a, ws, bs = ag_dim1_inputs(2, 2, 100, 128, [64], seed=280)
    with pytest.raises(ValueError, match="rows per batch entry"):
        run_ag_dim1(sw, a, ws, bs)
    xs, wr, br = rs_dim1_inputs(2, 2, 100, [128], 64, seed=281)
    with pytest.raises(ValueError, match="rows per batch entry"):
        run_rs_dim1(sw, xs, wr, br, "sum")


# ------------------------------------------------------------------------------------------------ faults


FAULT_SECONDS = 10.0


def _timed_fault(monkeypatch, warm, fn, bound_s):
    """Runs warm() (compiles the kernel for this bound's argument type), then times fn() until it raises. The
    callers check the time against FAULT_SECONDS, far under the 20 s default bound restored here: the short bound
    applied. Not bound + a little: the suite runs its groups side by side on one GPU, and a call there waited 2.7 s
    for a 0.25 s bound (the twenty-first session)."""
    runtime.set_spin_timeout(bound_s)
    try:
        warm()
        torch.cuda.synchronize()
        monkeypatch.setenv("KOSMOS_DEBUG_SYNC", "1")
        t0 = time.perf_counter()
        with pytest.raises(KernelTimeout) as info:
            fn()
        elapsed = time.perf_counter() - t0
    finally:
        runtime.set_spin_timeout(20.0)
    return info.value, elapsed


def test_missing_signal_raises_ag(monkeypatch):
    W = 4
    a, ws, bs = ag_inputs(W, 200, 256, [264], seed=21, bias_on=(False,))
    sw = SimWorld(W)
    bound = 0.25
    # rank 1 skips the release of its first PUBLISH: every peer's pull of that block must time out
    err, elapsed = _timed_fault(monkeypatch, lambda: run_ag(SimWorld(W), a, ws, bs),
                                lambda: sw.ag_gemm(a, ws, bs, drop_signal=(1, 0)), bound)
    assert err.op == "ag_gemm" and err.rank != 1
    group_m = ag_gemm.ag_config(W, 200, [264], 256, torch.bfloat16).group_m
    stream = queue.ag_gemm_stream(err.rank, W, 2, [2], sw.default_programs(), group_m)
    task = stream[err.task]
    # the first spin past the bound is the pull of that block or a tile waiting for the pulled block (the
    # grid claims this small stream at once, so either may start spinning first)
    assert task == (queue.PULL, 1, 0, 0) or (task[0] == queue.TILE and task[1:3] == (1, 0)), (err.rank, task)
    assert elapsed < FAULT_SECONDS, elapsed
    with pytest.raises(WorkspaceBroken):
        sw.ag_gemm(a, ws, bs)


def test_missing_signal_raises_rs(monkeypatch):
    W = 2
    xs, ws, b = rs_inputs(W, 136, [256], 264, seed=22)
    sw = SimWorld(W)
    bound = 0.25
    # rank 0's first task is its tile (0, 0) for owner 1: owner 1's fold of that tile times out
    err, elapsed = _timed_fault(monkeypatch, lambda: run_rs(SimWorld(W), xs, ws, b, "sum"),
                                lambda: sw.gemm_rs(xs, ws, b, "sum", drop_signal=(0, 0)), bound)
    assert (err.op, err.rank) == ("gemm_rs", 1)
    stream = queue.gemm_rs_stream(1, W, 2, 2, gemm_rs.rs_config(W * 136, 264, [256], torch.bfloat16, W).group_m)
    assert stream[err.task] == (queue.REDUCE, 1, 0, 0), stream[err.task]
    assert elapsed < FAULT_SECONDS, elapsed


def test_timeout_reported_at_next_call_without_debug_sync(monkeypatch):
    monkeypatch.delenv("KOSMOS_DEBUG_SYNC", raising=False)
    W = 2
    xs, ws, b = rs_inputs(W, 136, [256], 264, seed=23)
    sw = SimWorld(W)
    runtime.set_spin_timeout(0.1)
    try:
        sw.gemm_rs(xs, ws, b, "sum", drop_signal=(1, 0))
        torch.cuda.synchronize()
        with pytest.raises(KernelTimeout):
            sw.gemm_rs(xs, ws, b, "sum")
    finally:
        runtime.set_spin_timeout(20.0)


# ------------------------------------------------------------------------------------------------ graphs, stress, memory


def test_cuda_graph_replay_100():
    W = 4
    sw = SimWorld(W)
    a, ws, bs = ag_inputs(W, 136, 256, [264], seed=31, bias_on=(True,))
    xs, wr, br = rs_inputs(W, 72, [256], 264, seed=32)
    o = torch.empty(W, W * 136, 264, device="cuda", dtype=a.dtype)
    r = torch.empty(W, 72, 264, device="cuda", dtype=a.dtype)
    sw.ag_gemm(a, ws, bs, outs=[o])
    sw.gemm_rs(xs, wr, br, "sum", out=r)  # warm-up: compile, workspace, streams
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sw.ag_gemm(a, ws, bs, outs=[o])
        sw.gemm_rs(xs, wr, br, "sum", out=r)
    g = _gen(33)
    epoch0 = sw.workspace.epochs()
    for i in range(100):
        a.copy_(torch.randn(a.shape, device="cuda", generator=g))
        xs[0].copy_(torch.randn(xs[0].shape, device="cuda", generator=g))
        o.fill_(float("nan"))
        r.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(o, ag_reference(a, ws, bs)[0]) <= TOL, i
        assert rel_err(r, rs_reference(xs, wr, br, "sum")) <= TOL, i
    assert [e - e0 for e, e0 in zip(sw.workspace.epochs(), epoch0)] == [200] * W, "epochs advance on the device"


def test_500_random_launches_no_hang():
    rng = random.Random(0)
    worlds = {W: SimWorld(W) for W in WORLDS}
    checked = 0
    t0 = time.perf_counter()
    for i in range(500):
        W = rng.choice(WORLDS)
        sw = worlds[W]
        P = rng.choice([None, 1, 2, 5, max(1, sw.default_programs())])
        straggler = rng.choice([None, None, (rng.randrange(W), rng.choice([2_000, 50_000]))])
        check = i % 25 == 0
        if rng.random() < 0.5:
            m, K, N = rng.choice([64, 136, 200]), rng.choice([64, 128, 256]), rng.choice([64, 264, 512])
            a, ws, bs = ag_inputs(W, m, K, [N], seed=i, bias_on=(rng.random() < 0.5,))
            outs = sw.ag_gemm(a, ws, bs, programs=P, straggler=straggler, lookahead=rng.choice([None, 0, 3]))
            if check:
                assert rel_err(outs[0], ag_reference(a, ws, bs)[0]) <= TOL, i
                checked += 1
        else:
            mo, K, N = rng.choice([40, 72, 136]), rng.choice([64, 128, 256]), rng.choice([64, 264, 512])
            xs, ws, b = rs_inputs(W, mo, [K], N, seed=i, bias=rng.random() < 0.5)
            op = rng.choice(["sum", "avg"])
            out = sw.gemm_rs(xs, ws, b, op, programs=P, straggler=straggler)
            if check:
                assert rel_err(out, rs_reference(xs, ws, b, op)) <= TOL, i
                checked += 1
    torch.cuda.synchronize()
    for sw in worlds.values():
        sw.workspace.check()
    print(f"500 launches in {time.perf_counter() - t0:.1f} s, {checked} checked")


def test_peak_memory_within_unfused_plus_workspace():
    W = 2
    sw = SimWorld(W)
    m, K, N = 512, 1024, 2048
    a, ws, bs = ag_inputs(W, m, K, [N], seed=41, bias_on=(False,))
    sw.ag_gemm(a, ws, bs, return_gathered=True)  # workspace, stream, compile
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = sw.ag_gemm(a, ws, bs, return_gathered=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    unfused = sum(t.numel() * t.element_size() for t in res)  # gathered buffer + output
    assert peak <= unfused + (1 << 20), (peak, unfused)  # + descriptor scratch; the workspace is already there
    assert sw.workspace.nbytes > 0
    print(f"ag_gemm W={W}: peak {peak} B, gathered+out {unfused} B, workspace {sw.workspace.nbytes} B/rank")


def test_unaligned_rejected_by_launcher():
    sw = SimWorld(2)
    a = torch.randn(2, 136, 100, device="cuda", dtype=torch.bfloat16)  # K=100: 200-byte rows
    w = torch.randn(2, 100, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        sw.ag_gemm(a, [w])


# ------------------------------------------------------------------------------------------------ ops / backend


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    import kosmos.kernels.fused_ops  # noqa: F401  (registers the fused impls)

    return dist.group.WORLD.group_name


def _runs(op):
    import kosmos

    return {(k[1], k[2]): n for k, n in kosmos.report().runtime.items() if k[0] == op}


def test_ops_fused_on_size1_group(nccl_group):
    import kosmos

    kosmos.reset_report()
    g = _gen(51)
    a = torch.randn(4, 100, 256, device="cuda", generator=g).to(torch.bfloat16)
    wq = torch.randn(264, 256, device="cuda", generator=g).to(torch.bfloat16)
    wk = torch.randn(40, 256, device="cuda", generator=g).to(torch.bfloat16)
    bq = torch.randn(264, device="cuda", generator=g).to(torch.bfloat16)
    outs = torch.ops.kosmos.ag_gemm(a, [wq.t(), wk.t()], [bq, None], 0, 1, nccl_group, True, None)
    runs = _runs("ag_gemm")
    assert any(impl == "fused" for impl, _ in runs), runs
    assert rel_err(outs[0], a.float() @ wq.float().t() + bq.float()) <= TOL
    assert rel_err(outs[1], a.float() @ wk.float().t()) <= TOL
    assert torch.equal(outs[2], a)
    x = torch.randn(4, 100, 512, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(264, 512, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.ops.kosmos.gemm_rs([x], [w.t()], None, 0, "sum", 1, nccl_group, None)
    assert any(impl == "fused" for impl, _ in _runs("gemm_rs")), kosmos.report().runtime
    assert rel_err(out, x.float() @ w.float().t()) <= TOL
    from kosmos.kernels.fused_ops import workspace_bytes

    assert any(v > 0 for v in workspace_bytes().values())


def test_unaligned_takes_logged_reference(nccl_group):
    import kosmos

    kosmos.reset_report()
    a = torch.randn(200, 100, device="cuda", dtype=torch.bfloat16)  # K=100: rows of 200 bytes
    w = torch.randn(64, 100, device="cuda", dtype=torch.bfloat16)
    out = torch.ops.kosmos.ag_gemm(a, [w.t()], [None], 0, 1, nccl_group, False, None)[0]
    runs = _runs("ag_gemm")
    assert any(impl == "reference" and "16 bytes" in why for impl, why in runs), runs
    print("fallback reason:", runs)
    assert rel_err(out, a.float() @ w.float().t()) <= TOL


def test_ops_dim1_fused_or_reference_with_reason(nccl_group, monkeypatch):
    """gather_dim / scatter_dim 1 on a size-1 group: fused when the rows per batch entry fit the tile, else the
    reference path with the reason in kosmos.report()."""
    import kosmos
    from kosmos.kernels import fused_ops

    monkeypatch.setattr(fused_ops, "REMAP_ROWS", True)  # whatever KOSMOS_REMAP_ROWS says in this environment
    g = _gen(52)
    w = torch.randn(264, 256, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(264, device="cuda", generator=g).to(torch.bfloat16)
    wr = torch.randn(264, 512, device="cuda", generator=g).to(torch.bfloat16)
    for B, s, fused in [(2, 128, True), (3, 64, True), (2, 100, False), (3, 96, False)]:
        kosmos.reset_report()
        a = torch.randn(B, s, 256, device="cuda", generator=g).to(torch.bfloat16)
        why = fused_ops.why_not_ag_gemm(a, [w.t()], [b], 1, 1, nccl_group, True, None)
        outs = torch.ops.kosmos.ag_gemm(a, [w.t()], [b], 1, 1, nccl_group, True, None)
        runs = _runs("ag_gemm")
        if fused:
            assert why is None and any(impl == "fused" for impl, _ in runs), (B, s, why, runs)
        else:
            assert why is not None and f"s={s}" in why and "not a multiple of the tile" in why, why
            assert any(impl == "reference" and f"s={s}" in r for impl, r in runs), runs
        assert outs[0].shape == (B, s, 264)
        assert rel_err(outs[0], a.float() @ w.float().t() + b.float()) <= TOL
        assert torch.equal(outs[1], a)

        kosmos.reset_report()
        x = torch.randn(B, s, 512, device="cuda", generator=g).to(torch.bfloat16)
        why = fused_ops.why_not_gemm_rs([x], [wr.t()], None, 1, "sum", 1, nccl_group, None)
        out = torch.ops.kosmos.gemm_rs([x], [wr.t()], None, 1, "sum", 1, nccl_group, None)
        runs = _runs("gemm_rs")
        if fused:
            assert why is None and any(impl == "fused" for impl, _ in runs), (B, s, why, runs)
        else:
            assert why is not None and f"s={s}" in why, why
            assert any(impl == "reference" and f"s={s}" in r for impl, r in runs), runs
        assert out.shape == (B, s, 264)
        assert rel_err(out, x.float() @ wr.float().t()) <= TOL
    # the switch sends every remapped call back to the reference path
    a = torch.randn(2, 128, 256, device="cuda", generator=g).to(torch.bfloat16)
    old = fused_ops.REMAP_ROWS
    fused_ops.REMAP_ROWS = False
    try:
        why = fused_ops.why_not_ag_gemm(a, [w.t()], [b], 1, 1, nccl_group, False, None)
        assert why is not None and "REMAP_ROWS" in why, why
    finally:
        fused_ops.REMAP_ROWS = old


def test_backend_compiles_to_fused_kernel(nccl_group):
    import kosmos

    funcol = torch.ops._c10d_functional

    def fn(x, w):
        g = funcol.wait_tensor(funcol.all_gather_into_tensor(x, 1, nccl_group))
        return torch.mm(g, w)

    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 264, device="cuda", dtype=torch.bfloat16)
    eager = fn(x, w)
    torch._dynamo.reset()
    kosmos.reset_report()
    out = torch.compile(fn, backend="kosmos")(x, w)
    runs = _runs("ag_gemm")
    assert any(impl == "fused" for impl, _ in runs), (str(kosmos.report()), runs)
    assert rel_err(out, eager.float()) <= TOL
