"""MoE blocks in graphs without a backward (no_grad, inference): kosmos.passes.unused_saved_up runs their
kosmos::moe_layer with save_up=False, so the op neither writes nor allocates the up rows only a backward reads;
training forwards keep them. CPU, tiny HF Qwen3-MoE and DeepSeek-V3 blocks, fp32 (the reference impl)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kosmos  # noqa: E402
from graph_capture import compile_and_capture  # noqa: E402
from kosmos.ops import moe as moe_ops  # noqa: E402
from test_moe_pass import tiny_deepseek_v3, tiny_qwen3_moe  # noqa: E402

BLOCKS = {"qwen3_moe": (tiny_qwen3_moe, 0), "deepseek_v3": (tiny_deepseek_v3, 1)}  # builder, index of an MoE layer
TOKENS = 64


def _block(family):
    build, layer = BLOCKS[family]
    block = build().model.layers[layer].mlp
    torch.manual_seed(1)
    x = torch.randn(1, TOKENS, block.experts.gate_up_proj.shape[-1])
    return block, x


def _records(kind):
    return [r for r in kosmos.report().records if r.kind == kind]


@pytest.fixture
def up_requests(monkeypatch):
    """The return_up of every reference experts() call the op makes (the op reads the module global per call)."""
    seen = []
    experts = moe_ops.experts

    def spy(*args, return_up=False, **kwargs):
        seen.append(return_up)
        return experts(*args, return_up=return_up, **kwargs)

    monkeypatch.setattr(moe_ops, "experts", spy)
    return seen


@pytest.mark.parametrize("family", list(BLOCKS))
def test_no_grad_graph_skips_saved_up(family, up_requests):
    block, x = _block(family)
    with torch.no_grad():
        eager = block(x)
        graphs = compile_and_capture(block, x, backward=False, options={"tp_sp": False})
        up_requests.clear()
        out = torch.compile(block, backend="kosmos", options={"tp_sp": False})(x)
    code = graphs["inference"][0].code
    assert code.count("torch.ops.kosmos.moe_layer.default(") == 1, code
    assert "save_up = False" in code, code
    recs = _records("saved_up_skipped")
    assert [(r.graph, r.rewritten) for r in recs] == [("inference", True)], recs
    assert up_requests == [False], up_requests  # the op ran without the up rows
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_training_forward_keeps_saved_up(family, up_requests):
    block, x = _block(family)
    x.requires_grad_(True)
    graphs = compile_and_capture(block, x, options={"tp_sp": False})
    code = graphs["forward"][0].code
    assert code.count("torch.ops.kosmos.moe_layer.default(") == 1, code
    assert "save_up" not in code, code
    assert not _records("saved_up_skipped"), kosmos.report().records
    assert up_requests == [True], up_requests


def test_op_without_saved_up_same_outputs_and_grads():
    """save_up=False: output 3 is [0, 2I], the others are unchanged; a backward given the empty rows recomputes the
    up projection and gets the gradients of the saved-rows backward."""
    torch.manual_seed(0)
    T, H, I, E, k = 40, 32, 16, 6, 2
    h = torch.randn(T, H, requires_grad=True)
    rw = torch.randn(E, H, requires_grad=True)
    gu = (torch.randn(E, 2 * I, H) * 0.3).requires_grad_(True)
    d = (torch.randn(E, H, I) * 0.3).requires_grad_(True)
    g = torch.randn(T, H)
    runs = {}
    for save_up in (True, False):
        outs = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, k, "softmax", True, save_up=save_up)
        grads = torch.autograd.grad(outs[0], (h, rw, gu, d), g)
        runs[save_up] = (outs, grads)
    (with_up, grads_up), (without, grads) = runs[True], runs[False]
    assert tuple(with_up[3].shape) == (T * k + E, 2 * I) and tuple(without[3].shape) == (0, 2 * I)
    for i in (0, 1, 2, 4):
        assert torch.equal(with_up[i], without[i]), i
    for a, b in zip(grads_up, grads):  # two backward paths, sums in other orders: fp32 rounding apart
        assert ((a - b).norm() / b.norm()).item() <= 1e-5
