"""The pre-grad MoE pass on unmodified HF transformers v5 models (tiny configs, random weights, CPU):
Qwen3-MoE and DeepSeek-V3 blocks become one kosmos::moe_layer call, and after AOT autograd the forward graph
has one kosmos::moe_layer and the backward graph one kosmos::moe_layer_backward per MoE layer; candidates the
pass cannot take are left alone with a reason."""
from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
import torch.fx as fx
from expecttest import TestCase

transformers = pytest.importorskip("transformers")

import kosmos  # noqa: E402
from kosmos.passes import moe as moe_pass  # noqa: E402

OPTIONS = {"tp_sp": False}  # the MoE pass alone
GROUPED_MM = re.compile(r"torch\._grouped_mm\(|torch\.ops\.transformers\.grouped_mm_fallback\(")


# ------------------------------------------------------------------------------------------- models


def tiny_qwen3_moe(dtype=torch.float32, **overrides):
    """2 layers, both MoE: hidden 64, 8 experts of intermediate 32, top-2, renormalised."""
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
               norm_topk_prob=True, max_position_embeddings=64, router_aux_loss_coef=0.01)
    cfg.update(overrides)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).to(dtype)


def tiny_deepseek_v3(dtype=torch.float32, **overrides):
    """2 layers, the first dense: 8 routed experts in 2 groups (top-1 group), top-2, 1 shared expert, scaling 2.5."""
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
               topk_group=1, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64,
               routed_scaling_factor=2.5, norm_topk_prob=True)
    cfg.update(overrides)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg)).to(dtype)
    with torch.no_grad():  # a non-zero correction bias, so the selection path is exercised
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, gate.e_score_correction_bias.numel()))
    return model


MODELS = {"qwen3_moe": (tiny_qwen3_moe, 2), "deepseek_v3": (tiny_deepseek_v3, 1)}  # builder, MoE layers


def token_ids(batch=2, seq=8):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (batch, seq), generator=g)


# ------------------------------------------------------------------------------------------- capture


class _PostGradCapture:
    """The user's post-grad pass slot (runs after the kosmos passes): keeps every graph."""

    def __init__(self):
        self.graphs: list[fx.Graph] = []

    def __call__(self, graph):
        self.graphs.append(graph)

    def uuid(self):
        return None  # never cache


@dataclasses.dataclass
class Run:
    before: list[str]  # Dynamo graph code before the MoE pass, per graph
    after: list[fx.GraphModule]  # the same graphs after it
    forward: list[fx.Graph]
    backward: list[fx.Graph]
    report: kosmos.Report
    eager_loss: torch.Tensor
    eager_grads: dict
    loss: torch.Tensor
    grads: dict
    aux_loss: tuple = (None, None)  # (eager, compiled)


def _loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    aux = getattr(out, "aux_loss", None)
    return out.loss.detach(), grads, (aux.detach() if isinstance(aux, torch.Tensor) else None)


def compile_run(model, ids, fullgraph=True, **kwargs) -> Run:
    """Eager loss+grads, then the same with torch.compile(backend="kosmos"), capturing every graph."""
    eager_loss, eager_grads, eager_aux = _loss_and_grads(model, ids, **kwargs)
    before, after, post = [], [], _PostGradCapture()
    original = moe_pass.run

    def recording_run(gm, example_inputs, options):
        before.append(gm.code)
        n = original(gm, example_inputs, options)
        after.append(gm)
        return n

    torch._dynamo.reset()
    kosmos.reset_report()
    moe_pass.run = recording_run
    try:
        with torch._inductor.config.patch(fx_graph_cache=False, post_grad_custom_post_pass=post):
            compiled = torch.compile(model, backend="kosmos", options=OPTIONS, fullgraph=fullgraph)
            loss, grads, aux = _loss_and_grads(compiled, ids, **kwargs)
    finally:
        moe_pass.run = original
    from kosmos.passes.post_grad import graph_kind

    fwd = [g for g in post.graphs if graph_kind(g) != "backward"]
    bwd = [g for g in post.graphs if graph_kind(g) == "backward"]
    return Run(before, after, fwd, bwd, kosmos.report(), eager_loss, eager_grads, loss, grads, (eager_aux, aux))


def model_run(name: str, dtype: str, router_logits: bool = False) -> Run:
    """One compiled fwd+bwd per (model, dtype, router_logits), shared by the pass and numerics tests."""
    return _model_run(name, dtype, bool(router_logits))


@functools.lru_cache(maxsize=None)
def _model_run(name: str, dtype: str, router_logits: bool) -> Run:
    build, _ = MODELS[name]
    model = build(getattr(torch, dtype), output_router_logits=router_logits)
    return compile_run(model, token_ids())


def dynamo_graphs(model, ids, **kwargs) -> list[fx.GraphModule]:
    """Dynamo graphs only (no Inductor): a backend that keeps the graph and runs it as is."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=keep)(input_ids=ids, **kwargs)
    return graphs


# ------------------------------------------------------------------------------------------- snapshots


def _pretty(node: fx.Node, names: dict) -> str:
    if node not in names:
        if node.op == "placeholder" and ("parameters" in node.name or "buffers" in node.name):
            name = re.sub(r"^l_self_modules_|_$", "", node.name).replace("_modules_", ".")
            name = name.replace("_parameters_", ".").replace("_buffers_", ".")
        else:
            name = f"v{len(names)}"
        names[node] = name
    v = node.meta.get("val", node.meta.get("example_value"))
    if isinstance(v, torch.Tensor):
        dt = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}.get(v.dtype, str(v.dtype))
        return f"{names[node]}: {dt}{list(v.shape)}"
    return names[node]


def _render_arg(a, names):
    if isinstance(a, fx.Node):
        return _pretty(a, names)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_render_arg(x, names) for x in a) + "]"
    return repr(a).replace("torch.", "")


def _target_name(node: fx.Node) -> str:
    if node.op in ("output", "call_method"):
        return str(node.target)
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.name.split("::")[-1]
    return getattr(node.target, "__name__", str(node.target))


def kosmos_calls(graph: fx.Graph, op_names=("moe_layer", "moe_layer_backward", "moe_experts", "moe_experts_backward")) -> str:
    """The kosmos MoE calls of a graph and the nodes reading their outputs, with stable names and fake shapes."""
    names: dict = {}
    lines = []
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    for node in graph.nodes:
        target = str(node.target)
        if node.op != "call_function" or not any(f"kosmos.{n}." in target or f"kosmos::{n}" in target for n in op_names):
            continue
        op = target.replace("kosmos.", "").split(".")[0]
        args = ", ".join(_render_arg(a, names) for a in node.args)
        lines.append(f"{_pretty(node, names).split(':')[0]} = kosmos.{op}({args})")
        for user in node.users:
            idx = user.args[1] if _target_name(user) == "getitem" else "?"
            readers = sorted({_target_name(u) for u in user.users})
            lines.append(f"    [{idx}] {_pretty(user, names)} -> {', '.join(readers)}")
    return "\n".join(lines)


def count(graphs, op: str) -> int:
    pattern = f"kosmos.{op}.default"
    graphs = [g.graph if isinstance(g, fx.GraphModule) else g for g in graphs]
    return sum(1 for g in graphs for n in g.nodes if n.op == "call_function" and str(n.target) == pattern)


# ------------------------------------------------------------------------------------------- tests


CASES = [("qwen3_moe", "float32", True), ("qwen3_moe", "bfloat16", False), ("deepseek_v3", "float32", False),
         ("deepseek_v3", "bfloat16", False)]
IDS = [f"{m}-{d}{'-router_logits' if rl else ''}" for m, d, rl in CASES]


@pytest.mark.parametrize("name,dtype,router_logits", CASES, ids=IDS)
def test_untouched_graph_has_grouped_gemms(name, dtype, router_logits):
    run = model_run(name, dtype, router_logits)
    layers = MODELS[name][1]
    before = "\n".join(run.before)
    assert len(GROUPED_MM.findall(before)) == 2 * layers, before
    assert "torch.ops.kosmos" not in before
    assert "torch.sort(" in before and "torch.histc(" in before


@pytest.mark.parametrize("name,dtype,router_logits", CASES, ids=IDS)
def test_one_kosmos_call_per_layer_and_direction(name, dtype, router_logits):
    run = model_run(name, dtype, router_logits)
    layers = MODELS[name][1]
    assert run.report.count("moe_layer", "pre-grad") == layers, str(run.report)
    assert [r for r in run.report.left_alone if r.kind == "moe_layer"] == [], str(run.report)
    after = "\n".join(gm.code for gm in run.after)
    assert not GROUPED_MM.search(after), after
    assert count(run.after, "moe_layer") == layers
    assert count(run.forward, "moe_layer") == layers and count(run.forward, "moe_layer_backward") == 0
    assert count(run.backward, "moe_layer_backward") == layers and count(run.backward, "moe_layer") == 0
    for g in run.forward + run.backward:  # nothing of the block is left for Inductor
        targets = {str(n.target) for n in g.nodes}
        assert not {"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default", "aten.sort.default",
                    "aten.sort.stable"} & targets, targets
    runtime = {op for (op, impl, _), n in run.report.runtime.items()}
    assert {"moe_layer", "moe_layer_backward"} <= runtime


class TestSnapshots(TestCase):
    maxDiff = None

    def test_qwen3_moe_fp32_router_logits(self):
        run = model_run("qwen3_moe", "float32", True)
        self.assertExpectedInline(kosmos_calls(run.after[0]), """\
v4 = kosmos.moe_layer(v0: f32[16, 64], model.layers.0.mlp.gate.weight: f32[8, 64], None, None, model.layers.0.mlp.experts.gate_up_proj: f32[8, 64, 64], model.layers.0.mlp.experts.down_proj: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', True, None, 1)
    [0] v5: f32[16, 64] -> reshape
    [1] v6: f32[16, 8] -> output, to
v11 = kosmos.moe_layer(v7: f32[16, 64], model.layers.1.mlp.gate.weight: f32[8, 64], None, None, model.layers.1.mlp.experts.gate_up_proj: f32[8, 64, 64], model.layers.1.mlp.experts.down_proj: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', True, None, 1)
    [0] v12: f32[16, 64] -> reshape
    [1] v13: f32[16, 8] -> output, to""")
        self.assertExpectedInline(kosmos_calls(run.forward[0]), """\
v4 = kosmos.moe_layer(v0: f32[16, 64], v1: f32[8, 64], None, None, v2: f32[8, 64, 64], v3: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', True)
    [0] v5: f32[16, 64] -> reshape
    [1] v6: f32[16, 8] -> amax, output, sub
    [3] v7: f32[40, 64] -> output
    [4] v8: i32[16, 2] -> output
v13 = kosmos.moe_layer(v9: f32[16, 64], v10: f32[8, 64], None, None, v11: f32[8, 64, 64], v12: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', True)
    [0] v14: f32[16, 64] -> reshape
    [1] v15: f32[16, 8] -> amax, output, sub
    [3] v16: f32[40, 64] -> output
    [4] v17: i32[16, 2] -> output""")
        self.assertExpectedInline(kosmos_calls(run.backward[0]), """\
v9 = kosmos.moe_layer_backward(v0: f32[16, 64], v1: f32[16, 8], v2: f32[16, 64], v3: f32[8, 64], None, None, v4: f32[8, 64, 64], v5: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', None, 1, 'all_to_all', None, [True, True, True, True, True], v6: f32[40, 64], v7: i32[16, 2], v8: f32[16, 8])
    [0] v10: f32[16, 64] -> reshape
    [1] v11: f32[8, 64] -> output
    [2] v12: f32[8, 64, 64] -> output
    [3] v13: f32[8, 64, 32] -> output
v23 = kosmos.moe_layer_backward(v14: f32[16, 64], v15: f32[16, 8], v16: f32[16, 64], v17: f32[8, 64], None, None, v18: f32[8, 64, 64], v19: f32[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', None, 1, 'all_to_all', None, [True, True, True, True, True], v20: f32[40, 64], v21: i32[16, 2], v22: f32[16, 8])
    [0] v24: f32[16, 64] -> reshape
    [1] v25: f32[8, 64] -> output
    [2] v26: f32[8, 64, 64] -> output
    [3] v27: f32[8, 64, 32] -> output""")

    def test_qwen3_moe_bf16(self):
        run = model_run("qwen3_moe", "bfloat16")
        self.assertExpectedInline(kosmos_calls(run.after[0]), """\
v4 = kosmos.moe_layer(v0: bf16[16, 64], model.layers.0.mlp.gate.weight: bf16[8, 64], None, None, model.layers.0.mlp.experts.gate_up_proj: bf16[8, 64, 64], model.layers.0.mlp.experts.down_proj: bf16[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', False, None, 1)
    [0] v5: bf16[16, 64] -> reshape
v10 = kosmos.moe_layer(v6: bf16[16, 64], model.layers.1.mlp.gate.weight: bf16[8, 64], None, None, model.layers.1.mlp.experts.gate_up_proj: bf16[8, 64, 64], model.layers.1.mlp.experts.down_proj: bf16[8, 64, 32], 2, 'softmax', True, 1, 1, 1.0, None, 'silu', False, None, 1)
    [0] v11: bf16[16, 64] -> reshape""")

    def test_deepseek_v3_fp32(self):
        run = model_run("deepseek_v3", "float32")
        self.assertExpectedInline(kosmos_calls(run.after[0]), """\
v5 = kosmos.moe_layer(v0: f32[16, 64], model.layers.1.mlp.gate.weight: f32[8, 64], None, model.layers.1.mlp.gate.e_score_correction_bias: f32[8], model.layers.1.mlp.experts.gate_up_proj: f32[8, 64, 64], model.layers.1.mlp.experts.down_proj: f32[8, 64, 32], 2, 'sigmoid', True, 2, 1, 2.5, float32, 'silu', False, None, 1)
    [0] v6: f32[16, 64] -> view""")
        self.assertExpectedInline(kosmos_calls(run.forward[0]), """\
v5 = kosmos.moe_layer(v0: f32[16, 64], v1: f32[8, 64], None, v2: f32[8], v3: f32[8, 64, 64], v4: f32[8, 64, 32], 2, 'sigmoid', True, 2, 1, 2.5, float32)
    [0] v6: f32[16, 64] -> reshape
    [1] v7: f32[16, 8] -> output
    [3] v8: f32[40, 64] -> output
    [4] v9: i32[16, 2] -> output""")
        self.assertExpectedInline(kosmos_calls(run.backward[0]), """\
v9 = kosmos.moe_layer_backward(v0: f32[16, 64], None, v1: f32[16, 64], v2: f32[8, 64], None, v3: f32[8], v4: f32[8, 64, 64], v5: f32[8, 64, 32], 2, 'sigmoid', True, 2, 1, 2.5, float32, 'silu', None, 1, 'all_to_all', None, [True, True, True, True, True], v6: f32[40, 64], v7: i32[16, 2], v8: f32[16, 8])
    [0] v10: f32[16, 64] -> reshape
    [1] v11: f32[8, 64] -> output
    [2] v12: f32[8, 64, 64] -> output
    [3] v13: f32[8, 64, 32] -> output""")
        rec = run.report.rewrites[0]
        self.assertExpectedInline(rec.line(), """[pre-grad] moe_layer: rewritten: router (sigmoid top-2 of 1/2 groups, renormalised, x2.5) + grouped_mm SwiGLU experts + fold -> kosmos::moe_layer -> reference (cpu tensors (fused kernels need CUDA)) T=16 H=64 E=8 k=2 dtype=float32 I=32""")


# ------------------------------------------------------------------------------------------- left alone


def _pass_on(graphs) -> kosmos.Report:
    kosmos.reset_report()
    for gm in graphs:
        moe_pass.run(gm, None, None)
    return kosmos.report()


def test_eager_experts_left_alone_with_reason():
    model = tiny_qwen3_moe(num_hidden_layers=1)
    model.set_experts_implementation("eager")
    report = _pass_on(dynamo_graphs(model, token_ids()))
    assert report.rewrites == []
    reasons = [r.reason for r in report.left_alone]
    assert any("experts implementation is not 'grouped_mm'" in r and "experts_implementation='kosmos'" in r
               for r in reasons), reasons


def test_custom_scoring_router_left_alone_with_reason():
    model = tiny_qwen3_moe(num_hidden_layers=1)
    gate = model.model.layers[0].mlp.gate

    def tanh_router(hidden_states):  # a scoring function the op does not have
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states, gate.weight)
        scores = router_logits.tanh()
        values, indices = torch.topk(scores, gate.top_k, dim=-1)
        return router_logits, values, indices

    gate.forward = tanh_router
    graphs = dynamo_graphs(model, token_ids())
    report = _pass_on(graphs)
    assert report.rewrites == []
    (rec,) = report.left_alone
    assert rec.reason.startswith("unsupported router:") and "tanh" in rec.reason, rec.reason
    assert len(GROUPED_MM.findall("\n".join(gm.code for gm in graphs))) == 2  # untouched


def test_block_intermediate_used_outside_left_alone():
    model = tiny_qwen3_moe(num_hidden_layers=1)
    block = model.model.layers[0].mlp

    def forward_exposing_ids(hidden_states):  # the routing choice escapes the block
        b, s, h = hidden_states.shape
        flat = hidden_states.view(-1, h)
        _, weights, ids = block.gate(flat)
        out = block.experts(flat, ids, weights).reshape(b, s, h)
        return out + ids.sum().to(out.dtype) * 0

    block.forward = forward_exposing_ids
    report = _pass_on(dynamo_graphs(model, token_ids()))
    assert report.rewrites == []
    (rec,) = report.left_alone
    assert "also used by" in rec.reason and "outside the block" in rec.reason, rec.reason


def test_dense_model_untouched():
    model = tiny_deepseek_v3(first_k_dense_replace=2)  # both layers dense
    graphs = dynamo_graphs(model, token_ids())
    before = [gm.code for gm in graphs]
    report = _pass_on(graphs)
    assert report.records == [] and [gm.code for gm in graphs] == before
