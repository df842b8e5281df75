"""kosmos.kernels.launch_plan on the CPU: what a plan's key distinguishes, the cache's bound, and the direct launch's
argument order (the GPU side: tests/test_moe_kernel_gpu.py::test_plans_launch_tritons_own_build)."""
from __future__ import annotations

import inspect
import types

import torch

from kosmos.kernels import launch_plan


def test_tensor_key_tells_apart_what_triton_specializes_on():
    buf = torch.zeros(70, dtype=torch.float16)
    a, shifted = buf[:64].view(8, 8), buf[4:68].view(8, 8)  # shifted: 8 bytes past a 16-byte boundary
    key = launch_plan.tensor_key(a)
    assert key == launch_plan.tensor_key(buf[:64].view(8, 8))
    assert key != launch_plan.tensor_key(shifted)
    assert key != launch_plan.tensor_key(a.t())
    assert key != launch_plan.tensor_key(a.float())
    assert key != launch_plan.tensor_key(buf[:56].view(7, 8))
    assert launch_plan.tensor_key(torch.zeros(80, dtype=torch.float16)[8:72].view(8, 8)) == key  # 16 bytes on
    assert launch_plan.tensor_key(None) is None


def test_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(launch_plan, "MAX_PLANS", 3)
    cache = launch_plan.PlanCache()
    for i in range(3):
        cache.put(i, f"plan {i}")
    assert len(cache) == 3 and cache.get(2) == "plan 2"
    cache.put(3, "plan 3")
    assert len(cache) == 1 and cache.get(0) is None and cache.get(3) == "plan 3"


def _param(name, constexpr, default=inspect.Parameter.empty):
    return types.SimpleNamespace(name=name, is_constexpr=constexpr, default=default,
                                 has_default=default is not inspect.Parameter.empty)


class _Compiled:
    """A compiled kernel's stand-in: records grid and arguments of each launch."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


def test_direct_launch_appends_constexprs_in_parameter_order():
    kernel = types.SimpleNamespace(params=[_param("x", False), _param("n", False), _param("B", True),
                                           _param("A", True), _param("C", True, 7)])
    compiled = _Compiled()
    launch = launch_plan.direct_launch(kernel, compiled, (5,), 2, {"A": 1, "B": 2, "num_warps": 4})
    launch(("x", 3))
    launch(("y", 4))
    assert compiled.calls == [((5, 1, 1), ("x", 3, 2, 1, 7)), ((5, 1, 1), ("y", 4, 2, 1, 7))]


def test_direct_launch_refused_where_the_jit_must_bind():
    compiled = _Compiled()
    interleaved = types.SimpleNamespace(params=[_param("x", False), _param("B", True), _param("n", False)])
    assert launch_plan.direct_launch(interleaved, compiled, (1,), 2, {"B": 1}) is None
    missing = types.SimpleNamespace(params=[_param("x", False), _param("B", True)])
    assert launch_plan.direct_launch(missing, compiled, (1,), 1, {}) is None
    assert launch_plan.direct_launch(missing, None, (1,), 1, {"B": 1}) is None
    assert launch_plan.direct_launch(missing, compiled, (1,), 1, {"B": 1}) is not None


def test_carved_parts_start_on_16_byte_boundaries_and_do_not_overlap():
    for dtype in (torch.int64, torch.int32, torch.bfloat16, torch.uint8):
        parts = launch_plan.carved(dtype, "cpu", 3, 5, 1, 16, 0, 7)
        assert [p.numel() for p in parts] == [3, 5, 1, 16, 0, 7]
        assert all(p.dtype == dtype and p.is_contiguous() for p in parts)
        assert all(p.data_ptr() % 16 == 0 for p in parts if p.numel())
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in parts if p.numel())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_arg_key_tells_apart_what_triton_binds_a_build_by():
    buf = torch.zeros(40, dtype=torch.float16)
    key = launch_plan.arg_key(buf[:8])
    assert key == launch_plan.arg_key(buf[8:16]) and key != launch_plan.arg_key(buf[4:12])
    assert key != launch_plan.arg_key(buf[:8].float())
    assert launch_plan.arg_key(16) != launch_plan.arg_key(17)
    assert launch_plan.arg_key(1) != launch_plan.arg_key(True) and launch_plan.arg_key(1) != launch_plan.arg_key(1.0)
