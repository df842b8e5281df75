"""The MoE pass on HF transformers v5 MoE families beyond Qwen3-MoE and DeepSeek-V3 (tiny configs, random weights):
those whose router and experts are the op's forms are rewritten (one kosmos call per MoE layer and direction) and
match eager; the others are left alone with one reason per block that names what differs."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kosmos  # noqa: E402,F401
from test_moe_numerics import BF16_TOL, FP32_TOL, assert_close_grads, rel_err  # noqa: E402
from test_moe_pass import _pass_on, compile_run, count, dynamo_graphs, token_ids  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
             num_experts_per_tok=2)
FAMILIES = {  # name: (model class, config class, config beyond SMALL); every layer is an MoE layer
    # softmax(logits.float()) router, routing weights left in fp32 (bf16: the op's weights_dtype)
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=8)),
    # sigmoid(logits.float()) + correction bias, renormalised without DeepSeek-V3's epsilon
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config", dict(num_local_experts=8)),
    # greedy top-k, unsorted, no renormalisation, weights x routed_scaling_factor; fp32 router; a shared expert
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        n_routed_experts=8, routed_scaling_factor=2.0, first_k_dense_replace=0, n_shared_experts=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
    # Qwen3-MoE's router; a shared expert behind a sigmoid gate
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(num_experts=8, shared_expert_intermediate_size=32)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=8)),
    # DeepSeek-V3's router (sigmoid, correction bias, group-limited top-k)
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(n_routed_experts=8, n_group=2, topk_group=1,
                                                          first_k_dense_replace=0, n_shared_experts=1)),
    "dots1": ("Dots1ForCausalLM", "Dots1Config", dict(n_routed_experts=8, n_group=2, topk_group=1,
                                                     first_k_dense_replace=0, n_shared_experts=1)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(num_local_experts=8)),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(moe_num_experts=8, moe_k=2,
                                                                          moe_num_shared_experts=0,
                                                                          moe_layer_start_index=0)),
}


def build(name: str, dtype=torch.float32, **overrides):
    model_cls, config_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides}))
    with torch.no_grad():  # some routers start at zero (every expert tied): random weights
        for n, p in model.named_parameters():
            if not p.any() and "norm" not in n:
                p.copy_(torch.randn_like(p) * 0.02)
    return model.to(dtype)


@pytest.mark.parametrize("name,dtype", [("mixtral", "float32"), ("mixtral", "bfloat16"), ("deepseek_v2", "bfloat16"),
                                        ("qwen2_moe", "float32")])
def test_rewritten_and_matches_eager(name, dtype):
    run = compile_run(build(name, getattr(torch, dtype)), token_ids())
    assert run.report.count("moe_layer", "pre-grad") == SMALL["num_hidden_layers"], str(run.report)
    assert [r for r in run.report.left_alone if r.kind == "moe_layer"] == [], str(run.report)
    _assert_one_call_per_direction_and_eager_numerics(run, dtype)


def _assert_one_call_per_direction_and_eager_numerics(run, dtype: str) -> None:
    layers = SMALL["num_hidden_layers"]
    assert count(run.forward, "moe_layer") == layers and count(run.backward, "moe_layer_backward") == layers
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    assert rel_err(run.loss, run.eager_loss) <= tol, (run.loss, run.eager_loss)
    assert_close_grads(run.grads, run.eager_grads, tol)


@pytest.mark.parametrize("name,router", [("olmoe", "softmax top-2"), ("glm4_moe", "sigmoid top-2 of 1/2 groups"),
                                         ("dots1", "sigmoid top-2 of 1/2 groups")])
def test_every_block_rewritten(name, router):
    """The pass alone on the Dynamo graph: each MoE block becomes one moe_layer (the numerics of these router forms:
    Qwen3-MoE's and DeepSeek-V3's in test_moe_numerics.py)."""
    report = _pass_on(dynamo_graphs(build(name), token_ids()))
    assert report.left_alone == [], str(report)
    assert len(report.rewrites) == SMALL["num_hidden_layers"]
    assert all(router in r.reason for r in report.rewrites), [r.reason for r in report.rewrites]


def test_mixtral_bf16_keeps_fp32_weights():
    """Mixtral never casts its softmax's fp32 top-k values back to bf16: the call says so (weights_dtype), so the
    products with the bf16 expert outputs and their sum over the slots run in fp32, as in HF's experts."""
    report = _pass_on(dynamo_graphs(build("mixtral", torch.bfloat16, num_hidden_layers=1), token_ids()))
    (rec,) = report.rewrites
    assert "softmax top-2, renormalised, weights in float32" in rec.reason, rec.reason


def test_deepseek_v2_router_read_as_scaled_softmax():
    (rec,) = _pass_on(dynamo_graphs(build("deepseek_v2", num_hidden_layers=1), token_ids())).rewrites
    assert "softmax top-2, x2" in rec.reason and "renormalised" not in rec.reason, rec.reason


@pytest.mark.parametrize("name,dtype,why", [
    ("minimax_m2", "float32", "router logits: expected linear, found float"),
    ("gpt_oss", "float32", "experts activation: expected silu(gate) * up"),
    ("ernie4_5_moe", "float32", "router renormalisation sum: expected sum, found clamp"),
])
def test_left_alone_with_one_reason_per_block(name, dtype, why):
    model = build(name, getattr(torch, dtype), num_hidden_layers=1)
    report = _pass_on(dynamo_graphs(model, token_ids()))
    assert report.rewrites == []
    (rec,) = report.left_alone  # the block's reason only: no second entry for its router
    assert why in rec.reason, rec.reason


def test_deepseek_v2_group_limited_router_left_alone():
    """group_limited_greedy ranks groups by their best expert and zeroes the rest: not the op's group rule."""
    model = build("deepseek_v2", num_hidden_layers=1, topk_method="group_limited_greedy", n_group=2, topk_group=1)
    (rec,) = _pass_on(dynamo_graphs(model, token_ids())).left_alone
    assert rec.reason.startswith("unsupported router:"), rec.reason


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [("deepseek_v2", "bfloat16"), ("mixtral", "float32"), ("mixtral", "bfloat16"),
                                        ("qwen2_moe", "bfloat16")])
def test_rewritten_and_matches_eager_cuda(name, dtype):
    """On CUDA the rewritten calls take the fused forward (DeepSeek-V2: a softmax router in fp32 on bf16 hidden
    states, scaled weights; bf16 Mixtral: fp32 routing weights) and the default backward."""
    run = compile_run(build(name, getattr(torch, dtype)).cuda(), token_ids().cuda())
    impls = {impl: why for (op, impl, why) in run.report.runtime if op == "moe_layer"}
    assert list(impls) == ["fused"], impls
    _assert_one_call_per_direction_and_eager_numerics(run, dtype)
