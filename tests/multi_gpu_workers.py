"""Rank bodies for tests/test_multi_gpu.py: the fused TP+SP ops on a real NCCL group, one GPU per rank.

Each suite runs as fn(rank, world, ...) in its own spawned process (tests/_dist.run_ranks with backend="nccl")
and returns small results (floats, bools, strings) that the test asserts on. Ranks do not assert. If one rank
raised while its peer went on into the next collective, the peer would wait there until run_ranks killed both.
So each case catches its own exception and reports it as a string, and every rank runs the cases' collectives
in the same order. Shapes come from seeds shared by the ranks; values come from seeds that differ per rank.
References: NCCL all_gather_into_tensor / reduce_scatter_tensor plus torch.mm in fp32, cast to the dtype.
"""
from __future__ import annotations

import os
import random
import time
import traceback

import torch
import torch.distributed as dist

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
SPIN_S = 20.0  # a lost signal raises KernelTimeout after this long, well inside run_ranks' timeout

# A shard's K and a GEMM+RS N are all 8 mod 16 (16-byte rows, not multiples of 16 elements). Triton specializes
# some integer arguments on divisibility by 16, so values of one class share the compiled kernels across suites.
AG_K, RS_K = (136, 200, 264, 520), (136, 200, 264, 520)
AG_N, RS_N = (40, 104, 264, 520), (40, 72, 104, 264, 520)
ROWS = (72, 136, 200)  # rows per rank, none a multiple of the 128-row tile


# ------------------------------------------------------------------------------------------------ helpers


def _setup():
    import kosmos  # registers the ops, their fused impls and the backend
    from kosmos.kernels import runtime

    kosmos.reset_report()
    runtime.set_spin_timeout(SPIN_S)
    torch.backends.cuda.matmul.allow_tf32 = False
    return dist.group.WORLD


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def _has_nan(ts) -> bool:
    return any(bool(t.isnan().any()) for t in ts)


def _poison(shapes, dtype) -> None:
    """NaN-filled blocks of the outputs' sizes, freed at once: the op's torch.empty outputs most likely reuse
    them, so a tile the kernel never wrote shows as NaN instead of an earlier call's identical bytes."""
    blocks = [torch.full(tuple(s), float("nan"), device="cuda", dtype=dtype) for s in shapes]
    del blocks


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:1500] + "\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])[-2500:]


def _run_cases(cases) -> dict:
    """{name: fn() or {"error": ...}} for a list of (name, fn), in order."""
    out = {}
    for name, fn in cases:
        try:
            out[name] = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (reported to the test, which fails on it)
            out[name] = {"error": _error(e)}
    return out


def _impls(op: str) -> dict:
    """{impl: [reasons]} of `op` since the last kosmos.reset_report()."""
    import kosmos

    runs: dict = {}
    for (o, impl, reason), _n in kosmos.report().runtime.items():
        if o == op:
            runs.setdefault(impl, []).append(reason)
    return runs


def all_gather_ref(a: torch.Tensor, gather_dim: int, W: int, pg) -> torch.Tensor:
    raw = torch.empty(W * a.shape[0], *a.shape[1:], device=a.device, dtype=a.dtype)
    dist.all_gather_into_tensor(raw, a.contiguous(), group=pg)
    return raw if gather_dim == 0 else torch.cat(raw.chunk(W, 0), dim=gather_dim)


def ag_refs(gathered, weights, biases, dtype):
    return [(gathered.float() @ w.float() + (b.float() if b is not None else 0)).to(dtype)
            for w, b in zip(weights, biases)]


def rs_ref(xs, weights, bias, scatter_dim: int, reduce_op: str, W: int, pg, dtype) -> torch.Tensor:
    full = sum(x.float() @ w.float() for x, w in zip(xs, weights))
    if bias is not None:
        full = full + bias.float()  # every rank adds its own bias before the reduction (kosmos::gemm_rs)
    if scatter_dim != 0:
        full = torch.cat(full.chunk(W, dim=scatter_dim), dim=0)
    full = full.contiguous()
    out = torch.empty(full.shape[0] // W, *full.shape[1:], device=full.device, dtype=torch.float32)
    dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=pg)
    if reduce_op == "avg":
        out = out / W
    return out.to(dtype)


def ag_inputs(rank: int, seed: int, lead, K: int, Ns, bias_on, dtype):
    g = _gen(1000 * seed + rank)
    a = _randn((*lead, K), dtype, g)
    weights = [_randn((n, K), dtype, g).t() for n in Ns]  # Linear weights [N, K], used as w.t() like the graphs do
    biases = [_randn((n,), dtype, g) if on else None for n, on in zip(Ns, bias_on)]
    return a, weights, biases


def rs_inputs(rank: int, seed: int, lead, Ks, N: int, bias_on: bool, dtype):
    g = _gen(1000 * seed + rank)
    xs = [_randn((*lead, k), dtype, g) for k in Ks]
    weights = [_randn((N, k), dtype, g).t() for k in Ks]
    bias = _randn((N,), dtype, g) if bias_on else None
    return xs, weights, bias


def _gathered_shape(lead, K, gather_dim, W):
    shape = list(lead) + [K]
    shape[gather_dim] *= W
    return shape


def check_ag(pg, rank, W, *, seed, lead, K, Ns, bias_on, dtype=torch.bfloat16, gather_dim=0) -> dict:
    """One kosmos::ag_gemm call (return_gathered=True) against NCCL all_gather + fp32 mm."""
    import kosmos
    from kosmos.kernels import fused_ops

    a, weights, biases = ag_inputs(rank, seed, lead, K, Ns, bias_on, dtype)
    name = pg.group_name
    why = fused_ops.why_not_ag_gemm(a, weights, biases, gather_dim, W, name, True, None)
    gshape = _gathered_shape(lead, K, gather_dim, W)
    _poison([gshape[:-1] + [n] for n in Ns] + [gshape], dtype)
    kosmos.reset_report()
    res = torch.ops.kosmos.ag_gemm(a, weights, biases, gather_dim, W, name, True, None)
    runs = _impls("ag_gemm")
    gathered = all_gather_ref(a, gather_dim, W, pg)
    refs = ag_refs(gathered, weights, biases, dtype)
    return dict(why=why, runs=runs, errs=[rel_err(o, r) for o, r in zip(res[:-1], refs)],
                shapes=[list(o.shape) == list(r.shape) for o, r in zip(res[:-1], refs)],
                gathered_exact=same_bits(res[-1], gathered), nan=_has_nan(res), tol=TOL[dtype])


def check_rs(pg, rank, W, *, seed, lead, Ks, N, bias_on, reduce_op, dtype=torch.bfloat16, scatter_dim=0) -> dict:
    """One kosmos::gemm_rs call against fp32 mm + NCCL reduce_scatter_tensor."""
    import kosmos
    from kosmos.kernels import fused_ops

    xs, weights, bias = rs_inputs(rank, seed, lead, Ks, N, bias_on, dtype)
    name = pg.group_name
    why = fused_ops.why_not_gemm_rs(xs, weights, bias, scatter_dim, reduce_op, W, name, None)
    oshape = list(lead) + [N]
    oshape[scatter_dim] //= W
    _poison([oshape], dtype)
    kosmos.reset_report()
    out = torch.ops.kosmos.gemm_rs(xs, weights, bias, scatter_dim, reduce_op, W, name, None)
    runs = _impls("gemm_rs")
    ref = rs_ref(xs, weights, bias, scatter_dim, reduce_op, W, pg, dtype)
    return dict(why=why, runs=runs, errs=[rel_err(out, ref)], shapes=[list(out.shape) == list(ref.shape)],
                nan=_has_nan([out]), tol=TOL[dtype])


# ------------------------------------------------------------------------------------------------ suites


def ops_suite(rank: int, W: int, seed: int) -> dict:
    """Numerics of both ops through torch.ops.kosmos on shapes drawn from `seed`.
    Returns {case: check_ag / check_rs dict}; the case names say which path each must take."""
    pg = _setup()
    rng = random.Random(seed)  # the same draws on every rank
    pick = rng.choice

    def ag(name, **kw):
        return name, lambda: check_ag(pg, rank, W, seed=seed + len(name), **kw)

    def rs(name, **kw):
        return name, lambda: check_rs(pg, rank, W, seed=seed + 3 * len(name), **kw)

    qkv = [pick(AG_N) for _ in range(3)]
    cases = [
        # fused, gather / scatter along dim 0
        ag("fused_ag_qkv_bias_bf16", lead=(pick(ROWS),), K=pick(AG_K), Ns=qkv, bias_on=(True, True, True)),
        ag("fused_ag_qkv_nobias_bf16", lead=(pick(ROWS),), K=pick(AG_K), Ns=qkv, bias_on=(False, False, False)),
        ag("fused_ag_3d_shard_bf16", lead=(3, 40), K=pick(AG_K), Ns=[pick(AG_N)], bias_on=(True,)),
        ag("fused_ag_two_fp16", lead=(pick(ROWS),), K=pick(AG_K), Ns=[pick(AG_N), pick(AG_N)], bias_on=(True, False),
           dtype=torch.float16),
        rs("fused_rs_bias_sum_bf16", lead=(W * pick(ROWS),), Ks=[pick(RS_K)], N=pick(RS_N), bias_on=True,
           reduce_op="sum"),
        rs("fused_rs_pairs_bias_avg_bf16", lead=(W * pick(ROWS),), Ks=[pick(RS_K), pick(RS_K)], N=pick(RS_N),
           bias_on=True, reduce_op="avg"),
        rs("fused_rs_pairs_nobias_sum_bf16", lead=(2 * W, 40), Ks=[pick(RS_K), pick(RS_K)], N=pick(RS_N),
           bias_on=False, reduce_op="sum"),
        rs("fused_rs_avg_fp16", lead=(W * pick(ROWS),), Ks=[pick(RS_K)], N=pick(RS_N), bias_on=True,
           reduce_op="avg", dtype=torch.float16),
        # along dim 1 (local batch B >= 2): fused by row remapping when the rows per batch entry fit the tile,
        # else the reference path with the reason
        ag("dim1_ag_s128", lead=(2, 128), K=pick(AG_K), Ns=[pick(AG_N)], bias_on=(True,), gather_dim=1),
        ag("dim1_ag_s64_two", lead=(3, 64), K=pick(AG_K), Ns=[pick(AG_N), pick(AG_N)], bias_on=(False, True),
           gather_dim=1),
        rs("dim1_rs_s128_sum", lead=(2, W * 128), Ks=[pick(RS_K)], N=pick(RS_N), bias_on=True, reduce_op="sum",
           scatter_dim=1),
        rs("dim1_rs_s64_avg", lead=(3, W * 64), Ks=[pick(RS_K)], N=pick(RS_N), bias_on=False, reduce_op="avg",
           scatter_dim=1),
        ag("untiled_ag_s100", lead=(2, 100), K=pick(AG_K), Ns=[pick(AG_N)], bias_on=(True,), gather_dim=1),
        rs("untiled_rs_s100", lead=(2, W * 100), Ks=[pick(RS_K)], N=pick(RS_N), bias_on=True, reduce_op="sum",
           scatter_dim=1),
        # 200-byte rows (K or N = 100): not 16-byte aligned, the logged reference path
        ag("unaligned_ag_k100", lead=(pick(ROWS),), K=100, Ns=[pick(AG_N)], bias_on=(True,)),
        rs("unaligned_rs_n100", lead=(W * pick(ROWS),), Ks=[pick(RS_K)], N=100, bias_on=True, reduce_op="sum"),
    ]
    return _run_cases(cases)


def determinism_suite(rank: int, W: int, seed: int) -> dict:
    """The same AG (three weights, biases) and RS calls again: the public op, other program counts (the same on
    every rank, and different per rank), a rank delayed before the call (torch.cuda._sleep on its stream) and
    inside the kernel (straggler hook). Returns {"base": errors vs NCCL, variant: {"ag": bits equal, "rs": ...}}."""
    from kosmos.kernels.ag_gemm import ag_gemm_group
    from kosmos.kernels.gemm_rs import gemm_rs_group

    pg = _setup()
    name = pg.group_name
    dtype = torch.bfloat16
    m, K, Ns = 200, 264, [264, 40, 104]
    a, weights, biases = ag_inputs(rank, seed, (m,), K, Ns, (True, False, True), dtype)
    xs, wr, br = rs_inputs(rank, seed + 1, (W * 136,), [520], 264, True, dtype)
    ag_shapes = [[W * m, n] for n in Ns] + [[W * m, K]]
    rs_shapes = [[136, 264]]
    last = W - 1

    def ag_op():
        return torch.ops.kosmos.ag_gemm(a, weights, biases, 0, W, name, True, None)

    def rs_op():
        return [torch.ops.kosmos.gemm_rs(xs, wr, br, 0, "sum", W, name, None)]

    def ag_hook(**kw):
        return lambda: ag_gemm_group(a, weights, biases, W, name, True, None, **kw)

    def rs_hook(**kw):
        return lambda: [gemm_rs_group(xs, wr, br, "sum", W, name, None, **kw)]

    def sleep_then(fn):
        def run():
            if rank == last:
                torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles on this rank's stream before the launch
            return fn()
        return run

    variants = {
        "rerun": (ag_op, rs_op),
        "programs_3": (ag_hook(programs=3), rs_hook(programs=3)),
        "programs_1": (ag_hook(programs=1), rs_hook(programs=1)),
        "programs_per_rank": (ag_hook(programs=(5, 2)[rank % 2]), rs_hook(programs=(2, 7)[rank % 2])),
        "sleep_before_call": (sleep_then(ag_op), sleep_then(rs_op)),
        "straggler_in_kernel": (ag_hook(straggler=(last, 2_000_000)), rs_hook(straggler=(last, 2_000_000))),
        "straggler_rank0_programs_7": (ag_hook(programs=7, straggler=(0, 1_000_000)),
                                       rs_hook(programs=7, straggler=(0, 1_000_000))),
    }
    out: dict = {}
    kept = []  # every result stays allocated, so no later output can reuse a block holding identical bytes
    try:
        import kosmos

        kosmos.reset_report()
        base_ag, base_rs = ag_op(), rs_op()
        gathered = all_gather_ref(a, 0, W, pg)
        refs = ag_refs(gathered, weights, biases, dtype)
        out["base"] = dict(ag_errs=[rel_err(o, r) for o, r in zip(base_ag[:-1], refs)],
                           gathered_exact=same_bits(base_ag[-1], gathered),
                           rs_err=rel_err(base_rs[0], rs_ref(xs, wr, br, 0, "sum", W, pg, dtype)),
                           runs={"ag_gemm": _impls("ag_gemm"), "gemm_rs": _impls("gemm_rs")})
    except Exception as e:  # noqa: BLE001
        return {"base": {"error": _error(e)}}
    for vname, (ag_fn, rs_fn) in variants.items():
        def one(ag_fn=ag_fn, rs_fn=rs_fn):
            dist.barrier(group=pg)
            _poison(ag_shapes, dtype)
            got_ag = ag_fn()
            _poison(rs_shapes, dtype)
            got_rs = rs_fn()
            kept.append((got_ag, got_rs))
            return dict(ag=all(same_bits(x, y) for x, y in zip(got_ag, base_ag)) and len(got_ag) == len(base_ag),
                        rs=same_bits(got_rs[0], base_rs[0]), nan=_has_nan(got_ag + got_rs))
        out.update(_run_cases([(vname, one)]))
    return out


def graph_suite(rank: int, W: int, seed: int, replays: int) -> dict:
    """Both ops captured once in one CUDA graph (after eager warm-up), replayed `replays` times with the inputs
    changed in place before each replay, each replay checked against NCCL + fp32."""
    from kosmos.kernels import runtime

    pg = _setup()
    name = pg.group_name
    dtype = torch.bfloat16
    a, weights, biases = ag_inputs(rank, seed, (136,), 264, [264], (True,), dtype)
    xs, wr, br = rs_inputs(rank, seed + 1, (W * 72,), [264], 520, True, dtype)

    def step():
        outs = torch.ops.kosmos.ag_gemm(a, weights, biases, 0, W, name, False, None)
        return outs[0], torch.ops.kosmos.gemm_rs(xs, wr, br, 0, "sum", W, name, None)

    res: dict = {"errs_ag": [], "errs_rs": []}
    try:
        for _ in range(2):
            step()  # compile, workspace, task streams
        torch.cuda.synchronize()
        dist.barrier(group=pg)
        ws = runtime.group_workspace(name, a.device)
        bytes0, epoch0 = ws.nbytes, ws.epochs()[0]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            o_ag, o_rs = step()
        res["bytes_same_after_capture"] = ws.nbytes == bytes0
        g = _gen(7919 * seed + rank)
        for i in range(replays):
            a.copy_(torch.randn(a.shape, device="cuda", generator=g))
            xs[0].copy_(torch.randn(xs[0].shape, device="cuda", generator=g))
            o_ag.fill_(float("nan"))
            o_rs.fill_(float("nan"))
            graph.replay()
            ref_ag = ag_refs(all_gather_ref(a, 0, W, pg), weights, biases, dtype)[0]
            res["errs_ag"].append(rel_err(o_ag, ref_ag))
            res["errs_rs"].append(rel_err(o_rs, rs_ref(xs, wr, br, 0, "sum", W, pg, dtype)))
        torch.cuda.synchronize()
        res["epochs_advanced"] = ws.epochs()[0] - epoch0  # each replay runs both kernels: 2 per replay
        res["bytes_same_after_replays"] = ws.nbytes == bytes0
        ws.check()
    except Exception as e:  # noqa: BLE001
        res["error"] = _error(e)
    return res


def random_suite(rank: int, W: int, seed: int, launches: int, check_every: int) -> dict:
    """`launches` calls of both ops with shapes, biases, reduce ops, program counts and stragglers drawn from a
    small set (shared seed); every `check_every`-th call is checked against NCCL + fp32."""
    from kosmos.kernels import runtime
    from kosmos.kernels.ag_gemm import ag_gemm_group
    from kosmos.kernels.gemm_rs import gemm_rs_group

    pg = _setup()
    name = pg.group_name
    dtype = torch.bfloat16
    rng = random.Random(seed)
    res: dict = {"checked": 0, "errs": [], "launched": 0}
    t0 = time.perf_counter()
    try:
        for i in range(launches):
            P = rng.choice([None, None, 1, 3, 8])
            kw = dict(programs=None if P is None else P + rank,  # uneven program counts across ranks
                      straggler=rng.choice([None, None, None, (rng.randrange(W), 20_000)]))
            check = i % check_every == 0
            if rng.random() < 0.5:
                nw = rng.choice([1, 3])
                Ns = [rng.choice(AG_N) for _ in range(nw)]
                bias_on = [rng.random() < 0.5 for _ in range(nw)]
                a, weights, biases = ag_inputs(rank, seed + i, (rng.choice(ROWS),), rng.choice(AG_K[:3]), Ns,
                                               bias_on, dtype)
                outs = ag_gemm_group(a, weights, biases, W, name, False, None, **kw)
                if check:
                    refs = ag_refs(all_gather_ref(a, 0, W, pg), weights, biases, dtype)
                    res["errs"].append(max(rel_err(o, r) for o, r in zip(outs, refs)))
            else:
                op = rng.choice(["sum", "avg"])
                xs, wr, br = rs_inputs(rank, seed + i, (W * rng.choice(ROWS),), [rng.choice(RS_K[:3])],
                                       rng.choice(RS_N[:4]), rng.random() < 0.5, dtype)
                out = gemm_rs_group(xs, wr, br, op, W, name, None, **kw)
                if check:
                    res["errs"].append(rel_err(out, rs_ref(xs, wr, br, 0, op, W, pg, dtype)))
            res["launched"] += 1
            res["checked"] += int(check)
        torch.cuda.synchronize()
        runtime.group_workspace(name, torch.device("cuda", torch.cuda.current_device())).check()
    except Exception as e:  # noqa: BLE001
        res["error"] = _error(e)
    res["seconds"] = time.perf_counter() - t0
    return res


def compile_suite(rank: int, W: int, seed: int) -> dict:
    """torch.compile(backend="kosmos") of functional-collective functions on the NCCL group: all_gather_tensor
    + matmul, and matmul + reduce_scatter_tensor. Returns per function: rewrites, impls, error vs eager."""
    import torch.distributed._functional_collectives as funcol

    import kosmos

    pg = _setup()
    name = pg.group_name
    dtype = torch.bfloat16
    g = _gen(1000 * seed + rank)

    def ag_fn(x, w):
        return torch.mm(funcol.all_gather_tensor(x, 0, name), w.t())

    def rs_fn(x, w):
        return funcol.reduce_scatter_tensor(torch.mm(x, w.t()), "sum", 0, name)

    cases = {"ag_gemm": (ag_fn, _randn((200, 264), dtype, g), _randn((520, 264), dtype, g)),
             "gemm_rs": (rs_fn, _randn((W * 136, 264), dtype, g), _randn((264, 264), dtype, g))}
    out = {}
    for op, (fn, x, w) in cases.items():
        def one(op=op, fn=fn, x=x, w=w):
            eager = fn(x, w).float()  # float() waits on the functional collective's result
            torch._dynamo.reset()
            kosmos.reset_report()
            got = torch.compile(fn, backend="kosmos", fullgraph=True)(x, w)
            rep = kosmos.report()
            return dict(rewrites=rep.count(op), runs=_impls(op), err=rel_err(got, eager), tol=TOL[dtype],
                        shape=list(got.shape) == list(eager.shape), report=str(rep)[:3000])
        out.update(_run_cases([(op, one)]))
    return out


def fault_suite(rank: int, W: int, bound_s: float) -> dict:
    """A release dropped on purpose (drop_signal hook), with KOSMOS_DEBUG_SYNC=1 and the spin bound at `bound_s`:
    AG on the default group (rank 1 skips the signal of its first PUBLISH), then GEMM+RS on a second group (rank 0
    skips that of its first TILE, pushed to owner 1). Per op, the outcome of three calls: the faulted one, the
    same op again and then the other op on the same group (both through torch.ops.kosmos), each with its time and,
    for a KernelTimeout (own timeout) or a subclass of it ("aborted": a peer timed out first), the task it names
    (as a queue task tuple of that rank's stream)."""
    from kosmos.kernels import queue, runtime
    from kosmos.kernels.ag_gemm import ag_config, ag_gemm_group
    from kosmos.kernels.gemm_rs import gemm_rs_group, rs_config

    pg = _setup()
    pg_rs = dist.new_group(list(range(W)))  # a second workspace: the first one is unusable after the AG fault
    os.environ["KOSMOS_DEBUG_SYNC"] = "1"  # raise right after the launch, not at the next call
    dtype = torch.bfloat16
    m, K, N = 200, 264, 264
    a, weights, biases = ag_inputs(rank, 5, (m,), K, [N], (False,), dtype)
    xs, wr, br = rs_inputs(rank, 6, (W * 136,), [K], N, True, dtype)
    cfg = ag_config(W, m, [N], K, dtype)
    ag_stream = queue.ag_gemm_stream(rank, W, -(-m // cfg.block_m), [-(-N // cfg.block_n)],
                                     runtime.default_programs(a.device, 1), cfg.group_m, False)
    cfg = rs_config(W * 136, N, [K], dtype, W)
    rs_stream = queue.gemm_rs_stream(rank, W, -(-136 // cfg.block_m), -(-N // cfg.block_n), cfg.group_m)

    def ag_op(group):
        return lambda: torch.ops.kosmos.ag_gemm(a, weights, biases, 0, W, group.group_name, False, None)

    def rs_op(group):
        return lambda: torch.ops.kosmos.gemm_rs(xs, wr, br, 0, "sum", W, group.group_name, None)

    def attempt(fn, stream):
        t0 = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
            kind, info = "ok", {}
        except runtime.WorkspaceBroken:
            kind, info = "WorkspaceBroken", {}
        except runtime.KernelTimeout as e:
            # the class itself: this rank's own spin timed out; a subclass: it gave up after a peer's timeout
            kind = "KernelTimeout" if type(e) is runtime.KernelTimeout else "aborted"
            info = dict(op=e.op, rank=e.rank, task=list(stream[e.task]) if 0 <= e.task < len(stream) else None,
                        error=type(e).__name__)
        except Exception as e:  # noqa: BLE001
            kind, info = "other", dict(error=_error(e))
        return dict(outcome=kind, seconds=time.perf_counter() - t0, **info)

    def scenario(warm, calls):
        runtime.set_spin_timeout(SPIN_S)
        warm()  # compiled, and every rank launched once, before the short bound applies
        torch.cuda.synchronize()
        dist.barrier()
        runtime.set_spin_timeout(bound_s)
        out = []
        for fn, stream in calls:
            out.append(attempt(fn, stream))
            dist.barrier()  # the next call starts after every rank has seen this one end
        return out

    out = {"bound_s": bound_s}
    try:
        out["ag_gemm"] = scenario(ag_op(pg), [
            (lambda: ag_gemm_group(a, weights, biases, W, pg.group_name, False, None, drop_signal=(1, 0)), ag_stream),
            (ag_op(pg), ag_stream), (rs_op(pg), rs_stream)])
    except Exception as e:  # noqa: BLE001
        out["ag_gemm"] = {"error": _error(e)}
    try:
        out["gemm_rs"] = scenario(rs_op(pg_rs), [
            (lambda: gemm_rs_group(xs, wr, br, "sum", W, pg_rs.group_name, None, drop_signal=(0, 0)), rs_stream),
            (rs_op(pg_rs), rs_stream), (ag_op(pg_rs), ag_stream)])
    except Exception as e:  # noqa: BLE001
        out["gemm_rs"] = {"error": _error(e)}
    runtime.set_spin_timeout(SPIN_S)
    return out
