"""The TP+SP pass on unmodified HF Qwen3: kosmos' own plan and a plan kosmos did not write (fake process group)."""
from __future__ import annotations

import torch
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import kosmos
from graph_capture import (compile_and_capture, count_ops, fake_world, needs_dtensor_seq_shard_linear, skeleton,
                           unfused_pairs)

WORLD = 4
LAYERS = 2


def tiny_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def foreign_plan(model, mesh):
    """A DTensor-end-to-end plan as one might write it with torch's styles (colwise layers gather their input)."""
    layer_plan = {
        "input_layernorm": SequenceParallel(use_local_output=False),
        "post_attention_layernorm": SequenceParallel(use_local_output=False),
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, layer_plan)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    return model


class TestHFQwen3(TestCase):
    def capture(self, plan):
        with fake_world(WORLD):
            mesh = init_device_mesh("cpu", (WORLD,))
            model = plan(tiny_qwen3(), mesh)
            ids = torch.randint(0, 128, (2, 16))
            graphs = compile_and_capture(lambda ids: model(input_ids=ids).logits, ids, fullgraph=True)
        return graphs["forward"][0], graphs["backward"][0]

    def test_kosmos_plan(self):
        fwd, bwd = self.capture(kosmos.parallelize)
        # per layer: attention and MLP each one gather (fused into their projections) and one reduce-scatter
        self.assertEqual((count_ops(fwd.code, "ag_gemm"), count_ops(fwd.code, "gemm_rs")), (2 * LAYERS + 1, 2 * LAYERS))
        self.assertEqual((count_ops(bwd.code, "ag_gemm"), count_ops(bwd.code, "gemm_rs")), (2 * LAYERS, 2 * LAYERS + 1))
        self.assertEqual(unfused_pairs(fwd.graph) + unfused_pairs(bwd.graph), [])
        self.assertExpectedInline(skeleton(fwd.code, kosmos_only=True), """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3, t4], [None, None, None], 1, 4, '0', True)
t5 = torch.ops.kosmos.gemm_rs.default([t6], [t7], None, 1, 'sum', 4, '0', None)
t8 = torch.ops.kosmos.ag_gemm.default(t9, [t10, t11], [None, None], 1, 4, '0', True)
t12 = torch.ops.kosmos.gemm_rs.default([t13], [t14], None, 1, 'sum', 4, '0', None)
t15 = torch.ops.kosmos.ag_gemm.default(t16, [t17, t18, t19], [None, None, None], 1, 4, '0', True)
t20 = torch.ops.kosmos.gemm_rs.default([t21], [t22], None, 1, 'sum', 4, '0', None)
t23 = torch.ops.kosmos.ag_gemm.default(t24, [t25, t26], [None, None], 1, 4, '0', True)
t27 = torch.ops.kosmos.gemm_rs.default([t28], [t29], None, 1, 'sum', 4, '0', None)
t30 = torch.ops.kosmos.ag_gemm.default(t31, [t32], [None], 1, 4, '0', True)""")
        self.assertExpectedInline(skeleton(bwd.code, kosmos_only=True), """\
t0 = torch.ops.kosmos.gemm_rs.default([t1], [t2], None, 1, 'sum', 4, '0', None)
t3 = torch.ops.kosmos.ag_gemm.default(t4, [t5], [None], 1, 4, '0', True)
t6 = torch.ops.kosmos.gemm_rs.default([t7, t8], [t9, t10], None, 1, 'sum', 4, '0', None)
t11 = torch.ops.kosmos.ag_gemm.default(t12, [t13], [None], 1, 4, '0', True)
t14 = torch.ops.kosmos.gemm_rs.default([t15, t16, t17], [t18, t19, t20], None, 1, 'sum', 4, '0', None)
t21 = torch.ops.kosmos.ag_gemm.default(t22, [t23], [None], 1, 4, '0', True)
t24 = torch.ops.kosmos.gemm_rs.default([t25, t26], [t27, t28], None, 1, 'sum', 4, '0', None)
t29 = torch.ops.kosmos.ag_gemm.default(t30, [t31], [None], 1, 4, '0', True)
t32 = torch.ops.kosmos.gemm_rs.default([t33, t34, t35], [t36, t37, t38], None, 1, 'sum', 4, '0', None)""")

    @needs_dtensor_seq_shard_linear
    def test_foreign_plan(self):
        fwd, bwd = self.capture(foreign_plan)
        self.assertEqual(unfused_pairs(fwd.graph), [])
        self.assertExpectedInline(skeleton(fwd.code, kosmos_only=True), """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3, t4], [None, None, None], 1, 4, '0', True)
t5 = torch.ops.kosmos.gemm_rs.default([t6], [t7], None, 1, 'sum', 4, '0', None)
t8 = torch.ops.kosmos.ag_gemm.default(t9, [t10, t11], [None, None], 1, 4, '0', True)
t12 = torch.ops.kosmos.gemm_rs.default([t13], [t14], None, 1, 'sum', 4, '0', None)
t15 = torch.ops.kosmos.ag_gemm.default(t16, [t17, t18, t19], [None, None, None], 1, 4, '0', True)
t20 = torch.ops.kosmos.gemm_rs.default([t21], [t22], None, 1, 'sum', 4, '0', None)
t23 = torch.ops.kosmos.ag_gemm.default(t24, [t25, t26], [None, None], 1, 4, '0', True)
t27 = torch.ops.kosmos.gemm_rs.default([t28], [t29], None, 1, 'sum', 4, '0', None)
t30 = torch.ops.kosmos.ag_gemm.default(t31, [t32], [None], 1, 4, '0', True)""")
        self.assertExpectedInline(skeleton(bwd.code, kosmos_only=True), """\
t0 = torch.ops.kosmos.gemm_rs.default([t1], [t2], None, 1, 'sum', 4, '0', None)
t3 = torch.ops.kosmos.ag_gemm.default(t4, [t5], [None], 1, 4, '0', True)
t6 = torch.ops.kosmos.ag_gemm.default(t7, [t8], [None], 1, 4, '0', True)
t9 = torch.ops.kosmos.ag_gemm.default(t10, [t11], [None], 1, 4, '0', True)
t12 = torch.ops.kosmos.ag_gemm.default(t13, [t14], [None], 1, 4, '0', True)""")
        self.assertGreater(kosmos.report().count(graph="backward"), 0)
