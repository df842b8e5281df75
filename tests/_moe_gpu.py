"""What the MoE GPU test files share: their marks (a CUDA GPU with TMA), a 20 s spin bound (a hang raises in 20 s
instead of 300), exact fp32 matmuls (fp32 cases exact on both sides), the relative error; for the SimWorld files a
cache of simulated worlds and the poisoning of their workspaces. A test module takes the fixtures by importing them."""
from __future__ import annotations

import pytest
import torch

from kosmos.kernels import runtime
from kosmos.kernels.runtime import SimWorld

MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU with TMA (sm_90+)"),
]


@pytest.fixture(autouse=True, scope="module")
def spin_bound():
    runtime.set_spin_timeout(20.0)
    yield
    runtime.set_spin_timeout(None)


@pytest.fixture(autouse=True)
def exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


_worlds: dict = {}


def world(W: int) -> SimWorld:
    """The SimWorld of W ranks these tests share (one workspace per W)."""
    if W not in _worlds:
        _worlds[W] = SimWorld(W)
    return _worlds[W]


def worlds() -> list:
    """Every SimWorld `world` made so far."""
    return list(_worlds.values())


def poison(sw: SimWorld) -> None:
    """0xFF bytes (NaN in every float dtype) over the data of every rank's workspace: a row a kernel forgets to
    move shows up as NaN."""
    off = sw.workspace.layout.data_off
    for b in sw.workspace.buffers:
        b[off:].fill_(0xFF)
