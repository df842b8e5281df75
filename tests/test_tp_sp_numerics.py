"""The rewritten graphs compute what eager computes: TP+SP cases over gloo with 2 and 4 processes."""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks

# torch 2.11's DTensor cannot run the "implicit" case's sequence-sharded Linear, in eager either
# (graph_capture.needs_dtensor_seq_shard_linear)
_IMPLICIT = ["implicit"] if torch.__version__ >= (2, 12) else []
CASES = ["mlp", "attention", "batch1", "gather_dim0", *_IMPLICIT, "bias"]


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _check_cases(rank, world, cases):
    import kosmos
    from test_tp_sp_pass import _case

    for name in cases:
        torch.manual_seed(1234 + rank)
        fn, x = _case(name, world)
        params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
        x_leaf = getattr(x, "leaf", x)

        def step(f):
            for p in params:
                p.grad = None
            x_leaf.grad = None
            out = _local(f(x))
            out.float().pow(2).sum().backward()
            return out.detach().clone(), [_local(p.grad).clone() for p in params], x_leaf.grad.clone()

        eager = step(fn)
        torch._dynamo.reset()
        kosmos.reset_report()
        compiled = step(torch.compile(fn, backend="kosmos", fullgraph=True))
        assert kosmos.report().count() > 0, f"{name}: kosmos rewrote nothing"
        errs = [_rel(compiled[0], eager[0]), _rel(compiled[2], eager[2])]
        errs += [_rel(g, e) for g, e in zip(compiled[1], eager[1])]
        assert max(errs) <= 1e-5, f"{name} rank {rank}: rel errors {errs}"


@pytest.mark.multiproc
@pytest.mark.parametrize("world,cases", [(2, CASES), (4, ["mlp", *_IMPLICIT])])
def test_rewritten_cases_match_eager(world, cases):
    run_ranks(_check_cases, world, cases)
