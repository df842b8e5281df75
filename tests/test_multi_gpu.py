"""The fused TP+SP ops on a real NCCL group of 2 (4, 8) GPUs, with torch symmetric memory shared across processes.

Each test runs rank bodies from tests/multi_gpu_workers.py in W spawned processes, rank r on cuda:r
(tests/_dist.run_ranks, backend="nccl", NVLink multicast off), and checks what they return:
- ops: both ops through torch.ops.kosmos on seeded ragged shapes: bf16 and fp16, QKV-like weights with and
  without bias, several (input, weight) pairs, sum and avg. They take the fused path (why_not_* is None and
  kosmos.report() says fused) and match NCCL + fp32 torch. The gathered operand equals NCCL's all_gather bit for
  bit. Gathers and scatters along dim 1 are either fused or refused with a reason, and correct either way.
  Unaligned rows take the logged reference path and are correct;
- reruns are bit-identical over program counts (also different per rank), and with a rank delayed before the call
  and inside the kernel;
- a CUDA graph of both ops is replayed 50 times on inputs changed in place;
- 200 randomized launches run without a hang;
- torch.compile(backend="kosmos") of functional-collective code fuses and matches eager;
- a dropped signal raises KernelTimeout within the spin bound, then WorkspaceBroken. This test runs last, in its
  own processes.
Run with benchmarks/run_multi_gpu.sh on a machine with >= 2 GPUs; skipped elsewhere.
"""
from __future__ import annotations

import pytest
import torch

import multi_gpu_workers as mw
from _dist import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SM90 = GPUS >= 2 and torch.cuda.get_device_capability(0)[0] >= 9

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs (found {GPUS}); run with benchmarks/run_multi_gpu.sh"),
    pytest.mark.skipif(GPUS >= 2 and not SM90, reason="the fused kernels need TMA (sm_90+)"),
]

WORLDS = [pytest.param(W, marks=pytest.mark.skipif(GPUS < W, reason=f"needs {W} GPUs, found {GPUS}"))
          for W in (2, 4, 8)]
SEED = 20261130
TIMEOUT_S = 150  # per run_ranks call: spawn, NCCL init, Triton compiles, the work
FAULT_BOUND_S = 1.0

_memo: dict = {}


def _suite(fn, W: int, *args):
    """fn's results by rank, run once per (fn, W, args) for the tests that read them (a failure is kept too)."""
    key = (fn.__name__, W, args)
    if key not in _memo:
        try:
            _memo[key] = (True, run_ranks(fn, W, *args, backend="nccl", timeout=TIMEOUT_S))
        except Exception as e:  # noqa: BLE001
            _memo[key] = (False, f"{type(e).__name__}: {e}")
    ok, val = _memo[key]
    if not ok:
        pytest.fail(f"{fn.__name__} on {W} ranks failed: {val}", pytrace=False)
    return val


def _within(errs, tol) -> bool:
    """Every error <= tol (a NaN error fails)."""
    return all(e <= tol for e in errs)


def _numeric_problems(r: dict) -> list[str]:
    p = []
    if not all(r["shapes"]):
        p.append(f"output shapes differ from the reference's: {r['shapes']}")
    if r["nan"]:
        p.append("NaN in the outputs (a tile not written)")
    if not _within(r["errs"], r["tol"]):
        p.append(f"rel. errors {['%.2e' % e for e in r['errs']]} > {r['tol']}")
    if "gathered_exact" in r and not r["gathered_exact"]:
        p.append("the gathered operand differs from NCCL's all_gather")
    return p


def _fused_problems(r: dict) -> list[str]:
    p = []
    if r["why"] is not None:
        p.append(f"why_not says reference: {r['why']}")
    if set(r["runs"]) != {"fused"}:
        p.append(f"impls that ran: {r['runs']}")
    return p + _numeric_problems(r)


def _reference_problems(r: dict, *needles: str) -> list[str]:
    p = []
    why = r["why"]
    if why is None or not all(n in why for n in needles):
        p.append(f"why_not gave {why!r}, expected a reason with {needles}")
    elif r["runs"] != {"reference": [why]}:
        p.append(f"impls that ran: {r['runs']}, expected the reference path with its reason")
    return p + _numeric_problems(r)


def _check_cases(results: list[dict], prefix: str, check, at_least: int) -> None:
    problems, seen = [], 0
    for rank, res in enumerate(results):
        for name, r in res.items():
            if not name.startswith(prefix):
                continue
            seen += 1
            if "error" in r:
                problems.append(f"rank {rank} {name}: raised {r['error']}")
            else:
                problems += [f"rank {rank} {name}: {p}" for p in check(r)]
    assert seen >= at_least * len(results), f"only {seen} '{prefix}' cases ran"
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------ ops


@pytest.mark.parametrize("W", WORLDS)
def test_ag_gemm_fused_matches_nccl(W):
    _check_cases(_suite(mw.ops_suite, W, SEED), "fused_ag", _fused_problems, 4)


@pytest.mark.parametrize("W", WORLDS)
def test_gemm_rs_fused_matches_nccl(W):
    _check_cases(_suite(mw.ops_suite, W, SEED), "fused_rs", _fused_problems, 4)


@pytest.mark.parametrize("W", WORLDS)
def test_dim1_fused_or_reference_with_reason(W):
    results = _suite(mw.ops_suite, W, SEED)

    def either(r):
        return _fused_problems(r) if r["why"] is None else _reference_problems(r, "dim")

    _check_cases(results, "dim1_", either, 4)
    _check_cases(results, "untiled_", lambda r: _reference_problems(r, "s=100", "not a multiple of the tile"), 2)
    for name, r in results[0].items():
        if name.startswith("dim1_") and "why" in r:
            print(f"{name}: {'fused' if r['why'] is None else 'reference: ' + r['why']}")


@pytest.mark.parametrize("W", WORLDS)
def test_unaligned_takes_logged_reference(W):
    _check_cases(_suite(mw.ops_suite, W, SEED), "unaligned_", lambda r: _reference_problems(r, "16 bytes"), 2)


# ------------------------------------------------------------------------------------------------ determinism


def _variant_problems(results, names):
    problems = []
    for rank, res in enumerate(results):
        base = res["base"]
        if "error" in base:
            problems.append(f"rank {rank} base call raised {base['error']}")
            continue
        if not _within(base["ag_errs"] + [base["rs_err"]], mw.TOL[torch.bfloat16]):
            problems.append(f"rank {rank} base call: errors ag {base['ag_errs']} rs {base['rs_err']}")
        if not base["gathered_exact"]:
            problems.append(f"rank {rank} base call: gathered differs from NCCL's")
        if any(set(v) != {"fused"} for v in base["runs"].values()):
            problems.append(f"rank {rank} base call not fused: {base['runs']}")
        for v in names:
            r = res.get(v)
            if r is None or "error" in r:
                problems.append(f"rank {rank} {v}: {r and r['error']}")
            elif not (r["ag"] and r["rs"]) or r["nan"]:
                problems.append(f"rank {rank} {v}: bit-identical ag {r['ag']} rs {r['rs']}, NaN {r['nan']}")
    return problems


@pytest.mark.parametrize("W", WORLDS)
def test_reruns_bit_identical_over_program_counts(W):
    results = _suite(mw.determinism_suite, W, SEED)
    problems = _variant_problems(results, ["rerun", "programs_3", "programs_1", "programs_per_rank"])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("W", WORLDS)
def test_straggler_bit_identical(W):
    results = _suite(mw.determinism_suite, W, SEED)
    problems = _variant_problems(results, ["sleep_before_call", "straggler_in_kernel", "straggler_rank0_programs_7"])
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------ graphs, stress


@pytest.mark.parametrize("W", WORLDS)
def test_cuda_graph_replays_on_changing_inputs(W):
    replays = 50
    tol = mw.TOL[torch.bfloat16]
    for rank, r in enumerate(_suite(mw.graph_suite, W, SEED, replays)):
        assert "error" not in r, f"rank {rank}: {r['error']}"
        assert len(r["errs_ag"]) == len(r["errs_rs"]) == replays, (rank, len(r["errs_ag"]), len(r["errs_rs"]))
        bad = [(i, ea, er) for i, (ea, er) in enumerate(zip(r["errs_ag"], r["errs_rs"])) if not _within([ea, er], tol)]
        assert not bad, f"rank {rank}: replays off the reference (replay, ag err, rs err): {bad[:5]}"
        assert r["bytes_same_after_capture"] and r["bytes_same_after_replays"], f"rank {rank}: workspace grew"
        assert r["epochs_advanced"] == 2 * replays, f"rank {rank}: epochs advanced {r['epochs_advanced']}"


@pytest.mark.parametrize("W", WORLDS)
def test_200_random_launches(W):
    results = _suite(mw.random_suite, W, SEED, 200, 10)
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank} after {r['launched']} launches: {r['error']}"
        assert (r["launched"], r["checked"]) == (200, 20), r
        assert _within(r["errs"], mw.TOL[torch.bfloat16]), f"rank {rank}: {r['errs']}"
    print(f"200 launches in {max(r['seconds'] for r in results):.1f} s")


# ------------------------------------------------------------------------------------------------ backend


@pytest.mark.parametrize("W", WORLDS)
def test_torch_compile_fuses_functional_collectives(W):
    problems = []
    for rank, res in enumerate(_suite(mw.compile_suite, W, SEED)):
        for op in ("ag_gemm", "gemm_rs"):
            r = res.get(op, {"error": "missing"})
            if "error" in r:
                problems.append(f"rank {rank} {op}: {r['error']}")
                continue
            if r["rewrites"] < 1 or set(r["runs"]) != {"fused"}:
                problems.append(f"rank {rank} {op}: {r['rewrites']} rewrites, impls {r['runs']}\n{r['report']}")
            if not _within([r["err"]], r["tol"]) or not r["shape"]:
                problems.append(f"rank {rank} {op}: compiled vs eager rel. error {r['err']:.2e}, shape ok {r['shape']}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------ faults (last)


def _fault_problems(op: str, calls_by_rank: list, victims: set, expected_task, bound: float) -> list[str]:
    """Each rank's three calls: at most one 'ok' (only a rank that did not wait on the lost signal), then one
    KernelTimeout or an abort (a KernelTimeout subclass: a peer timed out first), then WorkspaceBroken. The victims
    (ranks waiting on the lost signal) raise in the faulted call. At least one rank raises a KernelTimeout of its
    own, naming the waiting task, after the bound and within bound + 5 s."""
    problems, genuine = [], []
    for rank, calls in enumerate(calls_by_rank):
        kinds = [c["outcome"] for c in calls]
        raised = [i for i, k in enumerate(kinds) if k in ("KernelTimeout", "aborted")]
        n_ok = raised[0] if raised else len(kinds)
        if (len(raised) != 1 or n_ok > 1 or kinds[:n_ok] != ["ok"] * n_ok
                or kinds[raised[0] + 1:] != ["WorkspaceBroken"] * (len(kinds) - raised[0] - 1)):
            problems.append(f"{op} rank {rank}: outcomes {kinds} (details {calls})")
            continue
        c = calls[raised[0]]
        if rank in victims and raised[0] != 0:
            problems.append(f"{op} rank {rank} waited on the lost signal but its faulted call returned: {kinds}")
        if c["op"] != op or c["rank"] != rank or c["seconds"] > bound + 5.0:
            problems.append(f"{op} rank {rank}: {c}")
        if c["outcome"] == "KernelTimeout":
            genuine.append((rank, c))
    if not genuine:
        problems.append(f"{op}: no rank raised a KernelTimeout of its own: {calls_by_rank}")
    for rank, c in genuine:
        if not expected_task(c["task"]) or c["seconds"] < 0.8 * bound:
            problems.append(f"{op} rank {rank}: KernelTimeout in task {c['task']} after {c['seconds']:.2f} s "
                            f"(bound {bound} s)")
    return problems


@pytest.mark.parametrize("W", WORLDS)
def test_missing_signal_raises_then_workspace_broken(W):
    from kosmos.kernels import queue

    results = _suite(mw.fault_suite, W, FAULT_BOUND_S)
    problems = []
    for op in ("ag_gemm", "gemm_rs"):
        errs = [(rank, r[op]["error"]) for rank, r in enumerate(results) if "error" in r[op]]
        if errs:
            problems += [f"{op} rank {rank}: {e}" for rank, e in errs]
            continue
        calls = [r[op] for r in results]
        if op == "ag_gemm":  # rank 1's first block never announced: every other rank's pull of it (or the tile
            # waiting for that pull) times out
            problems += _fault_problems(op, calls, set(range(W)) - {1}, lambda t: t is not None and (
                t == [queue.PULL, 1, 0, 0] or (t[0] == queue.TILE and t[1:3] == [1, 0])), FAULT_BOUND_S)
        else:  # rank 0's partial of owner 1's first tile never announced: owner 1's fold of that tile times out
            problems += _fault_problems(op, calls, {1}, lambda t: t == [queue.REDUCE, 1, 0, 0], FAULT_BOUND_S)
    for rank, r in enumerate(results):
        print(f"rank {rank}: " + "; ".join(f"{op} {[(c['outcome'], round(c['seconds'], 2)) for c in r[op]]}"
                                           for op in ("ag_gemm", "gemm_rs") if isinstance(r[op], list)))
    assert not problems, "\n".join(problems)
