"""What an MoE block saves for its backward: under backend="kosmos" the block is one kosmos::moe_layer whose registered
autograd saves the op's inputs, its saved_up output (the up projection of every routed pair, one zero pad row per
expert), the routing and the router logits (the backward recomputes the scores from them), so it keeps no more than HF's grouped_mm block under plain
Inductor (the MoE issue's rule: activations saved for backward no larger
than what that path saves). Measured with torch.autograd.graph.saved_tensors_hooks on the compiled module, storages
counted once, tiny HF Qwen3-MoE and DeepSeek-V3 blocks on CPU in fp32. (Peak device memory needs a GPU: not here.)"""
from __future__ import annotations

import re

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
    if family == "qwen3_moe":  # the block's inputs (hidden states and weights), saved_up, routing (int32), logits
        num_experts, two_i, _ = block.experts.gate_up_proj.shape
        pairs = TOKENS * model.config.num_experts_per_tok
        saved_up = (pairs + num_experts) * two_i * x.element_size()
        logits = TOKENS * num_experts * x.element_size()
        assert ours[0] == x.numel() * x.element_size() + params + saved_up + pairs * 4 + logits, (ours, params)


# ------------------------------------------------------------------ the backward overwrites saved_up (peak memory)


def _block_and_input(tokens=64):
    model = tiny_qwen3_moe()
    block = model.model.layers[0].mlp
    x = torch.randn(1, tokens, block.experts.gate_up_proj.shape[-1], requires_grad=True)
    return block, x


def _grads(fn, x, params, twice=False):
    """Gradients of fn(x).sin().sum() w.r.t. x and params; with twice, a second backward through the same graph."""
    loss = fn(x).sin().sum()
    first = torch.autograd.grad(loss, [x, *params], retain_graph=twice)
    return (first, torch.autograd.grad(loss, [x, *params])) if twice else first


def test_compiled_backward_writes_d_up_over_saved_up():
    """moe_layer_backward overwrites the donated saved_up buffer itself (kosmos.passes.donated_inplace): the
    backward allocates no copy of saved_up and runs no kernel besides the op (Inductor alone would copy the buffer
    onto itself: a clone it cannot reinplace, placed in the donated buffer)."""
    from torch._inductor.utils import run_and_get_code

    block, x = _block_and_input()
    torch._dynamo.reset()
    kosmos.reset_report()
    compiled = torch.compile(block, backend="kosmos", options={"tp_sp": False})
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    (backward,) = [c for c in codes if "moe_layer_backward" in c]
    call = next(line for line in backward.splitlines() if "moe_layer_backward.default(" in line)
    assert "clone" not in backward, backward
    passed = re.search(r"'all_to_all', None, \[[^]]*\], (\w+),", call)  # saved_up: a graph input, passed as it is
    assert passed, call
    saved_up = passed.group(1)
    inputs = next(line for line in backward.splitlines() if line.strip().endswith("= args"))
    assert saved_up in inputs.split("=")[0].replace(",", " ").split(), (saved_up, inputs)
    assert not re.search(r"\b(cpp_fused|triton_)\w*", backward.split("def call(")[1]), backward
    (rec,) = [r for r in kosmos.report().records if r.kind == "saved_up_in_place"]
    assert (rec.graph, rec.rewritten) == ("backward", True), rec.line()
    assert "overwrites its donated saved buffer itself" in rec.reason, rec.line()


def test_second_backward_through_overwritten_saved_up_raises_or_is_right():
    """retain_graph=True: a second backward must never read the overwritten saved_up. Eagerly autograd's version
    counter raises. Compiled, AOT autograd either raises (a backward compiled with donated buffers) or compiles the
    backward without donating saved_up (torch >= 2.13 when the first backward retains the graph; always with
    donated_buffer=False), and then the op overwrites a copy: both backwards are right."""
    import torch._functorch.config as functorch_config

    block, x = _block_and_input()
    params = [block.experts.gate_up_proj, block.experts.down_proj, block.gate.weight]
    want = _grads(block, x, params)
    op_args = (x[0], block.gate.weight, None, None, block.experts.gate_up_proj, block.experts.down_proj, 2,
               "softmax", True)
    loss = torch.ops.kosmos.moe_layer(*op_args)[0].sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # a cached graph keeps its own donation
        for donated in (True, False):
            with functorch_config.patch(donated_buffer=donated):
                torch._dynamo.reset()
                kosmos.reset_report()
                compiled = torch.compile(block, backend="kosmos", options={"tp_sp": False})
                try:
                    results = _grads(compiled, x, params, twice=True)
                except RuntimeError as e:
                    assert donated and "donated buffers" in str(e), e
                    continue
                # compiled without donating saved_up: the op overwrites Inductor's copy, and the report says why
                (rec,) = [r for r in kosmos.report().records if r.kind == "saved_up_in_place"]
                assert not rec.rewritten and "not a donated saved tensor" in rec.reason, rec.line()
                for got in results:
                    for a, b in zip(got, want):
                        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
        # the usual step (no retain_graph) then a retaining one: compiled with donation, so it must raise
        with functorch_config.patch(donated_buffer=True):
            torch._dynamo.reset()
            compiled = torch.compile(block, backend="kosmos", options={"tp_sp": False})
            _grads(compiled, x, params)
            with pytest.raises(RuntimeError, match="donated buffers"):
                _grads(compiled, x, params, twice=True)
