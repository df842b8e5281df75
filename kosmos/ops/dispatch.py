"""Chooses, per call, between a fused CUDA impl (registered by kosmos.kernels) and the reference impl."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from kosmos.kernels.runtime import KernelDoesNotFit
from kosmos.reporting import record_run

# op name -> (why_not(*args) -> reason or None, run(*args), detail(*args) -> what the report adds to "supported")
_fused: dict[str, tuple[Callable[..., Optional[str]], Callable, Optional[Callable[..., Optional[str]]]]] = {}


# name -> CUDA kernel of one step inside a reference impl (same math, fewer passes; not a choice to report)
_row_kernels: dict[str, Callable] = {}


def register_fused(op: str, why_not: Callable[..., Optional[str]], run: Callable,
                   detail: Optional[Callable[..., Optional[str]]] = None) -> None:
    """detail(*args): a note for the report's line of a fused run (e.g. a precision it chose), or None."""
    _fused[op] = (why_not, run, detail)


def register_row_kernel(name: str, fn: Callable) -> None:
    _row_kernels[name] = fn


def row_kernel(name: str, device: torch.device) -> Optional[Callable]:
    """The CUDA kernel registered as `name`, or None (the caller runs its torch math)."""
    return _row_kernels.get(name) if device.type == "cuda" else None


def why_reference(op: str, device: torch.device, *args) -> Optional[str]:
    """The reason `op` would take the reference impl on these args, or None when the fused impl runs."""
    if device.type != "cuda":
        return f"{device.type} tensors (fused kernels need CUDA)"
    if op not in _fused:
        return "no fused CUDA kernel registered for this op"
    return _fused[op][0](*args) if args else None


def try_fused(op: str, device: torch.device, *args, refuse: Optional[str] = None) -> tuple[bool, Any]:
    """Runs the fused impl of `op` on `args` when it takes them -> (True, its result); otherwise (False, None)
    and the caller runs the reference impl. Records which impl ran and why: the why_not reason, the caller's own
    `refuse` reason (where the reference does better on these args), or a kernel build that turned out not to fit
    the GPU (raised by the launcher before anything ran)."""
    reason = why_reference(op, device, *args) or refuse
    if reason is None:
        try:
            out = _fused[op][1](*args)
        except KernelDoesNotFit as e:
            reason = str(e)
        else:
            detail = _fused[op][2]
            note = detail(*args) if detail is not None else None
            record_run(op, "fused", f"supported; {note}" if note else "supported")
            return True, out
    record_run(op, "reference", reason)
    return False, None
