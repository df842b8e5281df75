"""The finder for MoE blocks that carry their own EP collectives (kosmos/passes/moe_ep_forms.py), and where Dynamo breaks
the forms it cannot capture in one graph (so a torch / transformers change that fixes or moves a break is noticed).

Forms (tests/ep_moe_models.py):
- TitanEpMoE (torchtitan-style all-to-all EP): breaks at `.tolist()` of the split sizes; one graph, forward and
  backward, with `capture_scalar_outputs=True`. Run on an in-process gloo group of 1 rank (real counts; the
  collectives are in the graph whatever the world size).
- transformers AllReduceEP: one graph in training, on a fake process group of 2 ranks.
- transformers AllToAllEP: breaks at `.tolist()`, and with `capture_scalar_outputs=True` still at
  `if tokens.shape[0] == 0` (a Python branch on a data-dependent size); the grouped GEMM and the combine land in a
  later graph than the dispatch. gloo group of 1 rank.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import kosmos
from ep_moe_models import TitanEpMoE, hf_ep_moe_block
from kosmos.passes import moe_ep_forms

SUFFIX = "; the MoE pass rewrites such a block only where it traces whole into one graph (README: expert-parallel forms)"


@contextlib.contextmanager
def world(backend: str, size: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def capture(module, x, *, scalars: bool = False):
    """Compiles module(x) (forward and backward) with a backend that keeps every Dynamo graph and the finder's
    candidates in it; returns (graphs, candidates per graph, output)."""
    torch._dynamo.reset()
    graphs, cands = [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        cands.append(moe_ep_forms.find_ep_moe_candidates(gm))
        return gm.forward

    with torch._dynamo.config.patch(capture_scalar_outputs=scalars):
        out = torch.compile(module, backend=backend)(x)
        (out.float() ** 2).sum().backward()
    return graphs, cands, out


def explain(module, x, *, scalars: bool = False):
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=scalars):
        return torch._dynamo.explain(module)(x)


def _titan():
    torch.manual_seed(0)
    return TitanEpMoE(16, 32, 4, 2), torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)


def test_titan_one_graph_with_capture_scalar_outputs():
    with world("gloo", 1):
        m, x = _titan()
        graphs, cands, out = capture(m, x, scalars=True)
        assert len(graphs) == 1
        (c,) = cands[0]
        assert c.reason() == (
            "candidate not yet fused: all-to-all EP (dispatch -> grouped GEMM of local experts -> combine) "
            "(token-count all_to_all_single, dispatch all_to_all_single, combine all_to_all_single)" + SUFFIX)
        assert c.shapes["gemms"] == 3 and c.shapes["local_experts"] == 4
        torch.testing.assert_close(out, m(x))
        ref = m.reference(x)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_titan_breaks_at_tolist_by_default():
    with world("gloo", 1):
        m, x = _titan()
        ex = explain(m, x)
        assert (ex.graph_count, ex.graph_break_count) == (2, 1)
        (br,) = ex.break_reasons
        assert "_local_scalar_dense" in br.reason  # .tolist() of the split sizes
        assert ".tolist()" in (br.user_stack[-1].line or "")
        graphs, cands, _ = capture(m, x)
        assert [len(c) for c in cands] == [0, 1]
        (c,) = cands[1]
        # the resumed graph holds dispatch, experts and combine, not the counts exchange nor the router
        assert c.reason() == (
            "candidate not yet fused: all-to-all EP (dispatch -> grouped GEMM of local experts -> combine) "
            "(dispatch all_to_all_single, combine all_to_all_single)" + SUFFIX)
        assert c.resumed_after is not None and c.resumed_after.startswith("ep_moe_models.py:")


def _hf_block(impl, mesh_size):
    from torch.distributed.device_mesh import init_device_mesh

    block = hf_ep_moe_block(impl, init_device_mesh("cpu", (mesh_size,)))
    if block is None:
        pytest.skip("this transformers has no transformers.distributed.expert_parallel")
    torch.manual_seed(0)
    return block, torch.randn(2, 8, 64, requires_grad=True)


def test_hf_all_reduce_ep_one_graph_and_recorded():
    with world("fake", 2):
        block, x = _hf_block("all_reduce", 2)
        graphs, cands, _ = capture(block, x)
        assert len(graphs) == 1
        (c,) = cands[0]
        assert c.reason() == (
            "candidate not yet fused: all-reduce EP (masked local experts -> grouped GEMM -> all_reduce of the output) "
            "(backward-only all_reduce in an autograd.Function, combine all_reduce in an autograd.Function)" + SUFFIX)
        assert c.shapes["local_experts"] == 2
        kosmos.reset_report()
        assert moe_ep_forms.run(graphs[0], None, None) == 1
        (rec,) = kosmos.report().left_alone
        assert (rec.kind, rec.graph, rec.rewritten, rec.reason) == ("moe_layer_ep", "pre-grad", False, c.reason())


@pytest.mark.parametrize("scalars", [False, True])
def test_hf_all_to_all_ep_breaks(scalars):
    with world("gloo", 1):
        block, x = _hf_block("all_to_all", 1)
        ex = explain(block, x, scalars=scalars)
        assert ex.graph_break_count >= 1
        reasons = " | ".join(b.reason for b in ex.break_reasons)
        if scalars:
            assert "data-dependent expression" in reasons  # `if tokens.shape[0] == 0` in AllToAllEP.__call__
        else:
            assert "_local_scalar_dense" in reasons  # .tolist() of the split sizes in _dispatch_tokens
        graphs, cands, _ = capture(block, x, scalars=scalars)
        found = [c for cs in cands for c in cs]
        assert len(graphs) > 1 and len(found) == 1
        (c,) = found
        assert c.is_half and c.resumed_after and c.resumed_after.startswith("expert_parallel.py:")
        assert c.reason().startswith(
            "candidate not yet fused: all-to-all EP, combine half (grouped GEMM -> combine; the dispatch is in an "
            "earlier graph) (combine all_to_all_single)" + SUFFIX + "; this graph resumes after a graph break at "
            "expert_parallel.py:")


def test_plain_moe_is_not_a_candidate():
    """A grouped-GEMM MoE without collectives is kosmos.passes.moe's business, not this finder's."""
    from _dist import tiny_hf_model

    block = tiny_hf_model("qwen3_moe").model.layers[1].mlp
    graphs, cands, _ = capture(block, torch.randn(2, 8, 64, requires_grad=True))
    assert len(graphs) == 1 and cands == [[]]
