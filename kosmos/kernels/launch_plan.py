"""Host work of a persistent kernel's launch kept across calls of one signature: the plans (checks, config, task
layout, constexprs) a launcher derives from its arguments' shapes, and the compiled kernel launched without
Triton's per-call argument binding.

A plan is keyed on everything it was derived from and everything Triton specializes a kernel on: each tensor's
shape, strides, dtype, device and whether its address is a multiple of 16, the scalars, and the global switches the
launcher reads. So a call that finds its key finds the same config and the same compiled kernel the full path
would pick (tests/test_moe_kernel_gpu.py checks the kernel against Triton's own binding). The runner it launches
through, CompiledKernel[grid], takes every parameter's value in order, constexprs included, from triton 3.6 to 3.9
(their sources). Measured on an H100's host (benchmarks/moe_forward_host.py, RESULTS.md fifty-eighth session): the
fused MoE forward's host work per call went from 280 to 140 us at Qwen3-30B-A3B T = 4096. `launch` keeps the
compiled kernel of launches whose only host work is Triton's binding (the reference backward's row kernels).
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from kosmos.kernels import runtime

# Plans per cache; a cache that fills (a new token count every step, say) starts over.
MAX_PLANS = 64


def tensor_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a plan depends on of tensor t: shape, strides, dtype, device, address modulo 16 (Triton's alignment
    specialization)."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def device_key(device: torch.device) -> tuple:
    """The device, and on CUDA the current device (where Triton loads the compiled kernel)."""
    return device, torch.cuda.current_device() if device.type == "cuda" else None


class PlanCache:
    """key -> plan, at most MAX_PLANS of them (thread-safe)."""

    def __init__(self):
        self._plans: dict = {}
        self._lock = threading.Lock()

    def get(self, key) -> Any:
        return self._plans.get(key)

    def put(self, key, plan) -> None:
        with self._lock:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


class DirectLaunch:
    """kernel's compiled build for one specialization, launched on the current stream with positional runtime
    arguments: Triton's CompiledKernel[grid] runner, with the constexprs appended in the kernel's parameter order.
    Skips JITFunction.run's binding, specialization and cache-key work, which is the same for every call of a plan
    (its key covers what Triton specializes on)."""

    def __init__(self, compiled, grid: tuple, tail: tuple):
        self.compiled, self.grid = compiled, grid
        self._runner, self._tail = compiled[tuple(grid) + (1,) * (3 - len(grid))], tail  # the runner reads 3 dims

    def __call__(self, args: tuple) -> None:
        self._runner(*args, *self._tail)


def direct_launch(kernel, compiled, grid: tuple, n_args: int, meta: dict) -> Optional[DirectLaunch]:
    """A DirectLaunch of `compiled` (kernel's build for this call's arguments) over grid, for calls with n_args
    positional runtime arguments and the constexprs in meta; None where the build or the kernel's parameters do not
    allow it (the interpreter, constexprs before runtime arguments): the caller launches through the JIT."""
    if compiled is None or runtime.interpreting() or not hasattr(compiled, "__getitem__"):
        return None
    params = getattr(kernel, "params", None)
    if params is None or len(params) < n_args:
        return None
    if any(p.is_constexpr for p in params[:n_args]) or not all(p.is_constexpr for p in params[n_args:]):
        return None
    if any(p.name not in meta and not p.has_default for p in params[n_args:]):
        return None
    tail = tuple(meta[p.name] if p.name in meta else p.default for p in params[n_args:])
    return DirectLaunch(compiled, grid, tail)


class JitLaunch:
    """kernel[grid](*args, **meta) through Triton's JIT, where no DirectLaunch can be built (the interpreter)."""

    def __init__(self, kernel, grid: tuple, meta: dict):
        self.kernel, self.grid, self.meta = kernel, grid, meta

    def __call__(self, args: tuple) -> None:
        self.kernel[self.grid](*args, **self.meta, **runtime.COMPILE_OPTIONS)


def kept_launch(kernel, grid: tuple, args: tuple, meta: dict):
    """A launch of kernel over grid with the constexprs meta, to keep for the calls whose arguments have the key of
    args: a DirectLaunch of its compiled build, else (the interpreter, a build without the runner) a JitLaunch.
    Either is called with the positional runtime arguments."""
    direct = None
    if not runtime.interpreting():
        direct = direct_launch(kernel, compiled_build(kernel, grid, args, meta), grid, len(args), meta)
    return direct or JitLaunch(kernel, grid, meta)


# (kernel, grid, constexprs, device, argument signature) -> the launch `launch` keeps for it
_launches = PlanCache()


class UncheckedArg:
    """An argument whose checks run once per signature (gemm_ws_host.HostDescriptor): `key()` holds what Triton
    specializes on and what the checks read, `checked()` is the checked object Triton's JIT binds. A kept direct
    launch takes the unchecked one as it is."""
    __slots__ = ()

    def key(self) -> tuple:
        raise NotImplementedError

    def checked(self) -> Any:
        raise NotImplementedError


def arg_key(a: Any) -> tuple:
    """What Triton specializes a build on of argument a: a tensor's dtype and address modulo 16, an UncheckedArg's
    key, a scalar's type and value (finer than Triton's own int32 / 16-divisible / 1 classes: a new value makes a
    new key, not another build)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16
    if isinstance(a, UncheckedArg):
        return a.key()
    return type(a), a


def checked_args(args: tuple) -> tuple:
    """args with each UncheckedArg checked: what Triton's JIT binds."""
    return tuple(a.checked() if isinstance(a, UncheckedArg) else a for a in args)


def launch(kernel, grid: tuple, args: tuple, **meta) -> None:
    """kernel[grid](*args, **meta) through the launch kept for this call's signature (kept_launch, made on its first
    call): for launches whose host work is Triton's JIT alone, whose checks and constexprs the caller makes. The key
    holds the grid, the constexprs, the current device and arg_key of every argument: what the JIT binds a build
    by. The build, and a launch through the JIT, take the UncheckedArgs checked."""
    interpreting = runtime.interpreting()
    device = None if interpreting else torch.cuda.current_device()
    key = (kernel, grid, tuple(meta.items()), device, *map(arg_key, args))
    plan = _launches.get(key)
    if plan is None:
        plan = kept_launch(kernel, grid, checked_args(args), meta)
        _launches.put(key, plan)
    plan(args if isinstance(plan, DirectLaunch) else checked_args(args))


def carved(dtype: torch.dtype, device, *numels: int) -> list:
    """1-d tensors of these lengths from one allocation, each starting on a 16-byte boundary as a fresh one does (what
    the kernels' fresh outputs are specialized on). Its split and slices cost host time too: on an H100's host a CUDA
    torch.empty took 2.4 us, a four-way split 4.6 and a slice 1.6 (RESULTS.md, sixty-first session), so a carve
    saves time only for many parts of lengths that need no slice."""
    per = max(1, 16 // dtype.itemsize)
    padded = [-(-n // per) * per for n in numels]
    parts = torch.empty(sum(padded), dtype=dtype, device=device).split(padded)
    return [part if n == p else part[:n] for part, n, p in zip(parts, numels, padded)]


def compiled_build(kernel, grid: tuple, args: tuple, meta: dict):
    """kernel's compiled build for these arguments (compiled now if it is not in Triton's cache)."""
    compiled = kernel.warmup(*args, grid=grid, **meta, **runtime.COMPILE_OPTIONS)
    return compiled.result() if hasattr(compiled, "result") else compiled
