"""kosmos.ops.version_bump: the mutable backward op's ADInplaceOrView kernel bumps saved_up's version counter (so a
second eager backward still raises) without torch's per-call schema walk, and refuses ops it does not fit."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

import kosmos  # noqa: F401  (registers the ops)
from kosmos.ops import version_bump


def _backward_args(saved_up_clone=True):
    g = torch.Generator().manual_seed(0)
    T, H, I, E, k = 8, 16, 8, 4, 2
    h, rw = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g)
    gu, d = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    out = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, k, "softmax", True)
    saved_up, ids, logits = out[3], out[4], out[1]
    go = torch.randn(T, H, generator=g)
    return (go, None, h, rw, None, None, gu, d, k, "softmax", True, 1, 1, 1.0, None, "silu", None, 1, "all_to_all",
            None, [True] * 5, saved_up.clone() if saved_up_clone else saved_up, ids, logits)


def test_moe_layer_backward_bumps_saved_up_alone():
    args = _backward_args()
    saved_up, hidden = args[21], args[2]
    before = saved_up._version, hidden._version
    with torch.no_grad():
        torch.ops.kosmos.moe_layer_backward.default(*args)
    assert saved_up._version > before[0] and hidden._version == before[1]


def test_moe_layer_backward_walks_no_schema(monkeypatch):
    """torch 2.13's own kernel calls fill_defaults on every call; kosmos's kernel, installed there, must not."""
    import torch._library.utils as library_utils

    def walked(*a, **k):
        raise AssertionError("fill_defaults called")

    args = _backward_args()
    monkeypatch.setattr(library_utils, "fill_defaults", walked)
    with torch.no_grad():
        torch.ops.kosmos.moe_layer_backward.default(*args)


def test_opcheck_moe_layer_backward_schema():
    """The schema's declared mutation (saved_up alone) is what the op does."""
    torch.library.opcheck(torch.ops.kosmos.moe_layer_backward.default, _backward_args(), test_utils=("test_schema",))


@torch.library.custom_op("kosmos_test::scaled_into", mutates_args=("out",))
def _scaled_into(x: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is not None:
        out.copy_(x * scale)
    return x * scale


@torch.library.custom_op("kosmos_test::scaled_into_torch_kernel", mutates_args=("out",))
def _scaled_into_torch_kernel(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


def test_walk_detected_as_torch_runs_it(monkeypatch):
    """torch_kernel_walks_schema (which decides whether moe.py installs the kernel) says what torch's own kernel does
    on this torch: a mutable op left with torch's kernel calls fill_defaults exactly when it says so."""
    import torch._library.utils as library_utils

    calls = []
    real = library_utils.fill_defaults
    monkeypatch.setattr(library_utils, "fill_defaults", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = torch.zeros(3)
    v = out._version
    torch.ops.kosmos_test.scaled_into_torch_kernel(torch.ones(3), out)
    assert out._version > v and bool(calls) == version_bump.torch_kernel_walks_schema()


def test_omitted_mutated_argument_and_kwargs():
    assert version_bump.install(torch.ops.kosmos_test.scaled_into.default, "out")
    x = torch.randn(4)
    y = torch.ops.kosmos_test.scaled_into(x, 2.0)  # out left out (the dispatcher drops a default None)
    assert torch.equal(y, x * 2)
    out = torch.zeros(4)
    v = out._version
    torch.ops.kosmos_test.scaled_into(x, 3.0, out)
    assert torch.equal(out, x * 3) and out._version > v
    v = out._version
    torch.ops.kosmos_test.scaled_into(x, 4.0, out=out)
    assert torch.equal(out, x * 4) and out._version > v


def test_refuses_an_op_it_does_not_fit():
    with pytest.raises(ValueError, match="mutating hidden alone"):
        version_bump.install(torch.ops.kosmos.moe_layer_backward.default, "hidden")
    with pytest.raises(ValueError, match="it mutates \\[\\]"):
        version_bump.install(torch.ops.kosmos.moe_layer.default, "hidden")
