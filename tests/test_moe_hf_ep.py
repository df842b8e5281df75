"""transformers' own expert parallelism under backend="kosmos" (tests/ep_moe_models.py: hf_ep_model).

AllReduceEP (`ep_implementation="all_reduce"` on transformers >= 5.21, the config's expert-parallel plan on 5.17)
traces into one graph per direction: the MoE pass turns the block,
its id remapping, its three autograd.Function wrappers and their all_reduces into one
`kosmos::moe_layer(..., ep_mode="all_reduce")` per direction (snapshots on a fake process group of 2 ranks), and the
compiled model matches eager HF over gloo with 2 and 4 processes, each rank on its own tokens (the op follows the
traced graph's semantics, not an assumption that the ranks hold the same data). AllToAllEP does not trace into one
graph; tests/test_moe_ep_forms.py checks that it is reported with the reason.
"""
from __future__ import annotations

import functools

import pytest
import torch
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

import kosmos
from _dist import run_ranks
from ep_moe_models import hf_ep_model
from graph_capture import fake_world
from kosmos.passes.moe import TRANSFORMERS_5_17_EP_NOTE
from test_moe_pass import compile_run, count, kosmos_calls

TOL = 1e-5


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(100 + rank))


def _model(world: int, family: str = "qwen3_moe"):
    experts = {"num_experts": 2 * world} if family == "qwen3_moe" else {"n_routed_experts": 2 * world,
                                                                        "num_key_value_heads": 4}
    model = hf_ep_model("all_reduce", init_device_mesh("cpu", (world,)), family=family, **experts)
    if model is None:
        pytest.skip("this transformers has no transformers.distributed.expert_parallel")
    return model


def _collectives(graphs) -> list[str]:
    return [str(n.target) for g in graphs for n in g.nodes if "c10d_functional" in str(n.target)]


@functools.lru_cache(maxsize=None)
def _fake_run():
    with fake_world(2):
        return compile_run(_model(2), _ids(0))


class TestAllReduceEpSnapshots(TestCase):
    maxDiff = None

    def test_one_call_per_direction_and_no_collectives_left(self):
        run = _fake_run()
        assert count(run.after, "moe_layer") == 1 and count(run.forward, "moe_layer") == 1
        assert count(run.backward, "moe_layer_backward") == 1
        assert _collectives(run.forward) == [] and _collectives(run.backward) == []
        # the call only: its reader differs (transformers 5.24 casts the output, 5.17 reshapes it)
        self.assertExpectedInline(kosmos_calls(run.after[0]).splitlines()[0], """\
v4 = kosmos.moe_layer(v0: f32[16, 64], model.layers.1.mlp.gate.weight: f32[4, 64], None, None, v2: f32[2, 64, 64], v3: f32[2, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', False, '0', 2, 'all_reduce')""")
        self.assertExpectedInline(kosmos_calls(run.forward[0]), """\
v4 = kosmos.moe_layer(v0: f32[16, 64], v1: f32[4, 64], None, None, v2: f32[2, 64, 64], v3: f32[2, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', False, '0', 2, 'all_reduce')
    [0] v5: f32[16, 64] -> reshape
    [3] v6: f32[0, 64] -> output
    [4] v7: i32[0, 2] -> output""")
        self.assertExpectedInline(kosmos_calls(run.backward[0]), """\
v7 = kosmos.moe_layer_backward(v0: f32[16, 64], None, v1: f32[16, 64], v2: f32[4, 64], None, None, v3: f32[2, 64, 64], v4: f32[2, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', '0', 2, 'all_reduce', None, [True, True, True, True, True], v5: f32[0, 64], v6: i32[0, 2])
    [0] v8: f32[16, 64] -> reshape
    [1] v9: f32[4, 64] -> output
    [2] v10: f32[2, 64, 64] -> output
    [3] v11: f32[2, 64, 32] -> output""")
        (rec,) = [r for r in run.report.records if r.kind == "moe_layer"]
        self.assertExpectedInline(rec.line().replace("; " + TRANSFORMERS_5_17_EP_NOTE, ""), """[pre-grad] moe_layer: rewritten: router (softmax top-2, renormalised) + grouped_mm SwiGLU experts + fold -> kosmos::moe_layer (expert parallel: group 0, 2 ranks, replicated tokens, outputs summed by all_reduce) -> reference (cpu tensors (fused kernels need CUDA)) T=16 H=64 E=4 k=2 dtype=float32 I=32""")


def test_traced_for_another_rank_is_left_alone():
    """The rank is a constant of the traced graph: a group whose rank differs is refused, not silently used."""
    from kosmos.passes import moe as moe_pass

    with fake_world(2):
        model = _model(2)
        block = model.model.layers[1].mlp
        graphs = []

        def keep(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(block, backend=keep)(torch.randn(2, 8, 64))
        (gm,) = graphs
        for n in gm.graph.nodes:  # pretend it was traced on rank 1
            if n.op == "call_function" and getattr(n.target, "__name__", "") == "ne" and n.args[1] == 0:
                n.args = (n.args[0], 1)
        matches, left, _ = moe_pass.find_moe_layers(gm.graph)
        assert matches == []
        assert any("is rank 0 of 2, the graph was traced for rank 1 of 2" in la.reason for la in left), left


# ---------------------------------------------------------------------------------------------- gloo numerics


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _loss_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): _local(p.grad).clone() for n, p in model.named_parameters()}


def _numerics(rank: int, world: int, same_tokens: bool, family: str) -> dict:
    model = _model(world, family)
    ids = _ids(0 if same_tokens else rank)
    eager_loss, eager_grads = _loss_grads(model, ids)
    torch._dynamo.reset()
    kosmos.reset_report()
    loss, grads = _loss_grads(torch.compile(model, backend="kosmos", fullgraph=True), ids)
    errs = {"loss": _rel(loss, eager_loss)}
    errs.update({name: _rel(grads[name], g) for name, g in eager_grads.items()})
    rewritten = [r.line() for r in kosmos.report().records if r.kind == "moe_layer" and r.rewritten]
    return {"errs": errs, "rewritten": rewritten}


@pytest.mark.multiproc
@pytest.mark.parametrize("family,world,same_tokens", [
    ("qwen3_moe", 2, False), ("qwen3_moe", 4, True), ("deepseek_v3", 2, False)],
    ids=["qwen3_moe-2-own-tokens", "qwen3_moe-4-same-tokens", "deepseek_v3-2-own-tokens"])  # (2-same-tokens: in 4's)
def test_all_reduce_ep_matches_eager_over_gloo(family, world, same_tokens):
    """Same tokens on every rank is what the form is for; with each rank's own tokens the forward mixes ranks'
    tokens, yet the rewrite still computes what the traced graph does (transformers >= 5.21; 5.17 sums the
    routing weights' gradient twice, which the report says the rewrite takes as one sum)."""
    for rank, res in enumerate(run_ranks(_numerics, world, same_tokens, family)):
        (line,) = res["rewritten"]
        assert "replicated tokens" in line, line
        if not same_tokens and "transformers 5.17 form" in line:
            pytest.skip("transformers 5.17's form equals the rewrite only when the ranks hold the same tokens")
        bad = {k: v for k, v in res["errs"].items() if not v <= TOL}
        assert not bad, f"world={world} rank={rank}: rel err > {TOL}: {bad}"
        assert len(res["errs"]) > 10  # loss and every parameter's gradient
