"""Expert parallelism on a real NCCL group, one process per GPU (tests/_dist.run_ranks): kosmos::moe_layer /
moe_layer_backward with ep_group_name run the fused EP kernels (kosmos.kernels.moe_ep / moe_ep_backward through
kosmos.kernels.moe_ep_group) on the group's symmetric-memory workspace. The rank functions and the inputs are in
tests/multi_gpu_ep_workers.py; W = 2, 4, 8 as the GPUs allow (one spawn per W).

* op cases: forward and backward through torch.ops.kosmos against the unsharded op's reference impl in float32 over
  every rank's tokens (bf16 rel err <= 2e-2, fp32 <= 1e-5): random and hot-expert routing (experts without rows get
  exact zero gradients; one rank's experts taking every row), a Qwen3-style softmax router, a DeepSeek-style sigmoid
  + group-limited fp32 router (correction bias, scaling, router logits and their gradient), the default env's pairing
  (fused forward, reference backward through the empty saved_up); global tokens_per_expert; each call's impl from
  kosmos.report() (fused, never a silent fallback); bit-identical reruns; a straggler rank (torch.cuda._sleep)
  through the op and through the launchers (and the kernel's own straggler hook, other grid sizes): bit-identical;
* refusals, each with its reason on every rank and the reference's results: token counts that differ between ranks,
  a rank without tokens, ep_mode="all_reduce", DeepSeek's fp32 router under the default env, a gloo group, a world
  size that does not match the group;
* a tiny HF Qwen3-MoE under kosmos.parallelize(expert_parallel=True) and torch.compile(backend="kosmos"): loss and
  every gradient against the unsharded eager model (fp32, TF32 off, rel err <= 1e-4), under the default env and
  KOSMOS_FUSED_MOE=1, the report naming the EP rewrite, the fused impls and the group's EP workspace;
* last, in its own spawn: a dropped signal (the launcher's drop_signal hook) ends in runtime.KernelTimeout within a
  1 s spin bound.
"""
from __future__ import annotations

import functools

import pytest
import torch

import multi_gpu_ep_workers as workers
from _dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability(0)[0] < 9,
                       reason="the fused EP kernels need TMA (sm_90+)"),
]

WORLDS = (2, 4, 8)
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
MODEL_TOL = 1e-4
OP_SUITE = list(workers.CASES) + ["fallbacks"]


def _need(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} here")


def _once(fn):
    """fn's result, or the exception it raised, kept: a failed spawn fails every test of it once, not once each."""
    cache: dict = {}

    @functools.wraps(fn)
    def wrapper(*args):
        if args not in cache:
            try:
                cache[args] = (True, fn(*args))
            except Exception as e:  # noqa: BLE001
                cache[args] = (False, e)
        ok, value = cache[args]
        if not ok:
            raise RuntimeError(f"{fn.__name__}{args} failed earlier: {value}")
        return value

    return wrapper


@_once
def _op_results(world: int) -> list:
    return run_ranks(workers.op_suite, world, OP_SUITE, backend="nccl", timeout=240 + 30 * world)


def _ok(res: dict, where: str) -> dict:
    assert "error" not in res, f"{where}: {res['error']}"
    return res


def _check_numbers(res: dict, tol: float, where: str) -> None:
    bad = {k: v for k, v in res["errs"].items() if not v <= tol}
    assert not bad, f"{where}: rel err > {tol}: {bad}"
    bad = [k for k, v in res["flags"].items() if not v]
    assert not bad, f"{where}: failed: {bad}"


def _impls(runtime: list) -> dict:
    """{op: [(impl, reason), ...]} of kosmos.report().runtime entries [(op, impl, reason, calls)]."""
    out: dict = {}
    for op, impl, why, _ in runtime:  # a fused run's note ("supported; router GEMM in 3xTF32 ...") is not compared
        out.setdefault(op, []).append((impl, "supported" if why.startswith("supported") else why))
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(workers.CASES))
def test_op_matches_unsharded_reference(world, case):
    _need(world)
    dtype, env = workers.CASES[case][0], workers.CASES[case][8]
    for rank, results in enumerate(_op_results(world)):
        where = f"{case} W={world} rank {rank}"
        res = _ok(results[case], where)
        impls = _impls(res["runtime"])
        assert impls["moe_layer"] == [("fused", "supported")], f"{where}: forward impls {impls}"
        if env == "1":
            assert impls["moe_layer_backward"] == [("fused", "supported")], f"{where}: backward impls {impls}"
        else:  # the default: fused forward, reference backward on the empty saved_up
            (impl, why), = impls["moe_layer_backward"]
            assert impl == "reference" and "opt-in" in why, f"{where}: backward impls {impls}"
        _check_numbers(res, TOL[dtype], where)
        if case == "bf16_random":
            bad = [k for k, v in res["hooks"].items() if not v]
            assert not bad, f"{where}: not bit-identical: {bad}"


@pytest.mark.parametrize("world", WORLDS)
def test_refusals_keep_the_reference_with_their_reason(world):
    _need(world)
    from kosmos.kernels.moe_ops import FP32_ROUTER_REASON

    for rank, results in enumerate(_op_results(world)):
        where = f"W={world} rank {rank}"
        res = _ok(results["fallbacks"], where)
        expect = {
            "token_counts_differ": lambda op: "different token counts",
            "rank0_without_tokens": lambda op: "no tokens (T == 0)" if rank == 0 else "another rank of EP group",
            "ep_mode_all_reduce": lambda op: "implement the all_to_all layout",
            "fp32_router_default_env": lambda op: FP32_ROUTER_REASON if op == "moe_layer" else "opt-in",
        }
        for name, want in expect.items():
            impls = _impls(res[name]["runtime"])
            for op in ("moe_layer", "moe_layer_backward"):
                (impl, why), = impls[op]
                assert impl == "reference" and want(op) in why, f"{where} {name}: {op} ran {impl} ({why})"
            tol = TOL[torch.bfloat16]
            bad = {k: v for k, v in res[name]["errs"].items() if not v <= tol}
            assert not bad, f"{where} {name}: rel err > {tol}: {bad}"
            assert all(res[name].get("flags", {}).values()), f"{where} {name}: {res[name]['flags']}"
        assert "NCCL" in (res["gloo_group_reason"] or ""), res["gloo_group_reason"]
        assert f"op says {2 * world}" in (res["world_size_mismatch_reason"] or ""), res["world_size_mismatch_reason"]


@_once
def _model_results() -> list:
    return run_ranks(workers.model_suite, 2, backend="nccl", timeout=200)


@pytest.mark.parametrize("env", ["None", "1"], ids=["default_env", "fused_both"])
def test_compiled_hf_qwen3_moe_matches_eager(env):
    for rank, res in enumerate(_model_results()):
        r = res[env]
        where = f"KOSMOS_FUSED_MOE={env} rank {rank}"
        assert r["loss_err"] <= MODEL_TOL, f"{where}: loss rel err {r['loss_err']}"
        bad = {k: v for k, v in r["grad_errors"].items() if not v <= MODEL_TOL}
        assert not bad, f"{where}: gradients differ from the unsharded eager model's: {bad}"
        assert len(r["grad_errors"]) > 10, r["grad_errors"]
        impls = _impls(r["runtime"])
        assert impls.get("moe_layer") == [("fused", "supported")], f"{where}: {impls}"
        want_bwd = "fused" if env == "1" else "reference"
        assert [i for i, _ in impls.get("moe_layer_backward", [])] == [want_bwd], f"{where}: {impls}"
        group, ep_world, _ = res["ep"]
        if env == "None":  # the first run compiled: the MoE pass's records are in its report
            assert any(f"expert parallel: group {group}, {ep_world} ranks" in line for line in r["moe_rewrites"]), \
                r["moe_rewrites"]
        uses = [u for name, u in r["workspace_uses"].items() if name.startswith(f"{group}@")]
        assert uses and "moe_layer EP forward" in uses[0], f"{where}: workspaces {r['workspace_uses']}"
        if env == "1":
            assert "moe_layer EP backward" in uses[0], f"{where}: workspaces {r['workspace_uses']}"


def test_missing_signal_raises_kernel_timeout():
    """Last: the group's workspaces end broken. Every rank waits for the dropped token counts, so every rank
    raises: KernelTimeout where its own spin timed out, KernelAborted (a KernelTimeout) where a peer's timeout
    stopped it first; its next call raises WorkspaceBroken."""
    results = run_ranks(workers.timeout_suite, 2, backend="nccl", timeout=100)
    assert all(r["raised"] for r in results), f"a rank did not raise: {results}"
    for rank, r in enumerate(results):
        assert r["seconds"] < 15, f"rank {rank}: the call took {r['seconds']:.1f} s with a 1 s spin bound"
        assert r["device_error"][0] != 0, f"rank {rank}: no error word on the device: {r}"
        if r["raised"]:
            assert "moe_layer" in r["raised"] and "spin bound" in r["raised"], r["raised"]
            assert r["next_call"].startswith("WorkspaceBroken"), r["next_call"]
