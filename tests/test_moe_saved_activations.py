"""What an MoE block saves for its backward: under backend="kosmos" the block is one kosmos::moe_layer whose registered
autograd saves the op's inputs and its saved_up output (the up projection of every routed pair, one zero pad row
per expert; the backward recomputes the routing), so it keeps no more than HF's grouped_mm block under plain
Inductor (the MoE issue's rule: activations saved for backward no larger
than what that path saves). Measured with torch.autograd.graph.saved_tensors_hooks on the compiled module, storages
counted once, tiny HF Qwen3-MoE and DeepSeek-V3 blocks on CPU in fp32. (Peak device memory needs a GPU: not here.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kosmos  # noqa: E402
from test_moe_pass import tiny_deepseek_v3, tiny_qwen3_moe  # noqa: E402

BLOCKS = {"qwen3_moe": (tiny_qwen3_moe, 0), "deepseek_v3": (tiny_deepseek_v3, 1)}  # builder, index of an MoE layer
TOKENS = 256


def saved_bytes(fn, x) -> tuple[int, int]:
    """(bytes, tensors) the autograd graph of fn(x) keeps for backward, each storage counted once. fn runs once
    before (compiling: the hook must not see the fake tensors of tracing)."""
    fn(x)
    storages: dict = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(storages.values()), len(storages)


@pytest.mark.parametrize("family", list(BLOCKS))
def test_kosmos_saves_no_more_than_inductor(family):
    build, layer = BLOCKS[family]
    model = build()
    block = model.model.layers[layer].mlp
    x = torch.randn(1, TOKENS, block.experts.gate_up_proj.shape[-1], requires_grad=True)
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    torch._dynamo.reset()
    inductor = saved_bytes(torch.compile(block, backend="inductor"), x)
    torch._dynamo.reset()
    kosmos.reset_report()
    ours = saved_bytes(torch.compile(block, backend="kosmos", options={"tp_sp": False}), x)
    report = kosmos.report()
    assert report.count("moe_layer", "pre-grad") == 1, str(report)
    assert ours[0] <= inductor[0], (ours, inductor)
    if family == "qwen3_moe":  # the block's inputs (hidden states and weights) and saved_up
        num_experts, two_i, _ = block.experts.gate_up_proj.shape
        saved_up = (TOKENS * model.config.num_experts_per_tok + num_experts) * two_i * x.element_size()
        assert ours[0] == x.numel() * x.element_size() + params + saved_up, (ours, params, saved_up)
