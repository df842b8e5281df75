"""TP+SP post-grad pass: snapshots of rewritten fwd/bwd graphs on a fake process group, and negative cases."""
from __future__ import annotations

import torch
import torch.nn as nn
from expecttest import TestCase
from torch.distributed.device_mesh import init_device_mesh

import kosmos
import tp_models as tm
from graph_capture import (compile_and_capture, count_ops, fake_world, needs_dtensor_seq_shard_linear, skeleton,
                           unfused_pairs)

WORLD = 4


def _case(name: str, world: int = WORLD):
    """Builds (fn, input) for one TP+SP case on the current (fake or gloo) world."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    if name == "mlp":
        m = tm.plan_module_input(tm.MLP(), mesh)
        return m, torch.randn(2, 8, tm.H, requires_grad=True)
    if name == "attention":
        m = tm.plan_module_input(tm.Attention(), mesh)
        return m, torch.randn(2, 8, tm.H, requires_grad=True)
    if name == "batch1":
        m = tm.plan_module_input(tm.MLP(), mesh)
        return m, torch.randn(1, 8, tm.H, requires_grad=True)
    if name == "gather_dim0":
        m = tm.plan_module_input(tm.MLP(), mesh, seq_dim=0)
        return m, torch.randn(8, tm.H, requires_grad=True)
    if name == "implicit":
        m = tm.plan_implicit(tm.MLP(), mesh)
        leaf = torch.randn(2, 8, tm.H, requires_grad=True)
        x = tm.seq_sharded(leaf, mesh)
        x.leaf = leaf  # the tensor whose grad the numerics test reads
        return m, x
    if name == "autocast":
        m = tm.plan_module_input(tm.MLP(), mesh)

        def fn(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(x)

        return fn, torch.randn(2, 8, tm.H, requires_grad=True)
    if name == "bias":
        m = tm.plan_module_input(tm.MLP(bias=True), mesh)
        return m, torch.randn(2, 8, tm.H, requires_grad=True)
    raise KeyError(name)


class TestTpSpSnapshots(TestCase):
    def run_case(self, name, ag_fwd, rs_fwd, ag_bwd, rs_bwd):
        with fake_world(WORLD):
            fn, x = _case(name)
            graphs = compile_and_capture(fn, x, fullgraph=True)
        self.assertEqual((len(graphs["forward"]), len(graphs["backward"])), (1, 1), "expected one graph each way")
        fwd, bwd = graphs["forward"][0], graphs["backward"][0]
        self.assertEqual(
            (count_ops(fwd.code, "ag_gemm"), count_ops(fwd.code, "gemm_rs"), count_ops(bwd.code, "ag_gemm"), count_ops(bwd.code, "gemm_rs")),
            (ag_fwd, rs_fwd, ag_bwd, rs_bwd),
        )
        self.assertEqual(kosmos.report().count(), ag_fwd + rs_fwd + ag_bwd + rs_bwd)
        return fwd, bwd

    def fused_case(self, name, *counts):
        fwd, bwd = self.run_case(name, *counts)
        self.assertEqual(unfused_pairs(fwd.graph) + unfused_pairs(bwd.graph), [])
        return skeleton(fwd.code), skeleton(bwd.code)

    def test_mlp(self):
        fwd, bwd = self.fused_case("mlp", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 1, 4, '0', True)
t4 = t0[0]
t5 = t0[1]
t6 = t0[2]
t7 = torch.ops.kosmos.gemm_rs.default([t8], [t9], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(bwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 1, 4, '0', True)
t2 = t0[0]
t3 = t0[1]
t4 = torch.ops.aten.mm.default(t5, t6)
t7 = torch.ops.aten.mm.default(t8, t9)
t10 = torch.ops.aten.mm.default(t11, t9)
t12 = torch.ops.kosmos.gemm_rs.default([t13, t14], [t15, t16], None, 1, 'sum', 4, '0', None)""")

    def test_attention(self):
        fwd, bwd = self.fused_case("attention", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3, t4], [None, None, None], 1, 4, '0', True)
t5 = t0[0]
t6 = t0[1]
t7 = t0[2]
t8 = t0[3]
t9 = torch.ops.kosmos.gemm_rs.default([t10], [t11], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(bwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 1, 4, '0', True)
t2 = t0[0]
t3 = t0[1]
t4 = torch.ops.aten.mm.default(t5, t6)
t7 = torch.ops.aten.mm.default(t8, t9)
t10 = torch.ops.aten.mm.default(t11, t9)
t12 = torch.ops.aten.mm.default(t13, t9)
t14 = torch.ops.kosmos.gemm_rs.default([t15, t16, t17], [t18, t19, t20], None, 1, 'sum', 4, '0', None)""")

    def test_local_batch_1(self):
        fwd, bwd = self.fused_case("batch1", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 0, 4, '0', True)
t4 = t0[0]
t5 = t0[1]
t6 = t0[2]
t7 = torch.ops.kosmos.gemm_rs.default([t8], [t9], None, 0, 'sum', 4, '0', None)""")
        self.assertExpectedInline(bwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 0, 4, '0', True)
t2 = t0[0]
t3 = t0[1]
t4 = torch.ops.aten.mm.default(t5, t6)
t7 = torch.ops.aten.mm.default(t8, t9)
t10 = torch.ops.aten.mm.default(t11, t9)
t12 = torch.ops.kosmos.gemm_rs.default([t13, t14], [t15, t16], None, 1, 'sum', 4, '0', None)""")

    def test_gather_dim_0(self):
        fwd, bwd = self.fused_case("gather_dim0", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 0, 4, '0', True)
t4 = t0[0]
t5 = t0[1]
t6 = t0[2]
t7 = torch.ops.kosmos.gemm_rs.default([t8], [t9], None, 0, 'sum', 4, '0', None)""")
        self.assertExpectedInline(bwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 0, 4, '0', True)
t2 = t0[0]
t3 = t0[1]
t4 = torch.ops.aten.mm.default(t5, t6)
t7 = torch.ops.aten.mm.default(t8, t9)
t10 = torch.ops.aten.mm.default(t11, t9)
t12 = torch.ops.kosmos.gemm_rs.default([t13, t14], [t15, t16], None, 0, 'sum', 4, '0', None)""")

    @needs_dtensor_seq_shard_linear
    def test_implicit_redistribute(self):
        # DTensor end to end: the gather reaches the matmuls through an index permutation + as_strided
        # (torch 2.14 gives each consumer its own wait_tensor); the unfused leftovers differ by version
        fwd, bwd = self.run_case("implicit", 1, 1, 1, 0)
        self.assertEqual(unfused_pairs(fwd.graph), [])
        self.assertExpectedInline(skeleton(fwd.code, kosmos_only=True), """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 1, 4, '0', True)
t4 = torch.ops.kosmos.gemm_rs.default([t5], [t6], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(skeleton(bwd.code, kosmos_only=True), """t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 1, 4, '0', True)""")
        reasons = [r.reason for r in kosmos.report().left_alone if r.kind == "gemm_rs" and r.graph == "backward"]
        # (the mul's node name differs by torch version)
        mul = "mul_12" if (2, 12) <= torch.__version__ < (2, 13) else "mul_9"
        self.assertIn(f"the unreduced matmul output is also used by {mul}", reasons)

    def test_autocast_moves_cast_before_gather(self):
        fwd, bwd = self.fused_case("autocast", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 1, 4, '0', True)
t4 = t0[0]
t5 = t0[1]
t6 = t0[2]
t7 = torch.ops.kosmos.gemm_rs.default([t8], [t9], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(bwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2], [None], 1, 4, '0', True)
t3 = t0[0]
t4 = t0[1]
t5 = torch.ops.aten.mm.default(t6, t7)
t8 = torch.ops.aten.mm.default(t9, t10)
t11 = torch.ops.aten.mm.default(t12, t10)
t13 = torch.ops.kosmos.gemm_rs.default([t14, t15], [t16, t17], None, 1, 'sum', 4, '0', torch.float32)""")
        rec = [r for r in kosmos.report().rewrites if r.kind == "ag_gemm" and r.graph == "forward"][0]
        self.assertIn("cast to torch.bfloat16 moved before the gather", rec.reason)

    def test_bias(self):
        fwd, bwd = self.fused_case("bias", 1, 1, 1, 1)
        self.assertExpectedInline(fwd, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [t4, t5], 1, 4, '0', True)
t6 = t0[0]
t7 = t0[1]
t8 = t0[2]
t9 = torch.ops.kosmos.gemm_rs.default([t10], [t11], t12, 1, 'sum', 4, '0', None)""")


def _gathered(x):
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, WORLD, "0"))


class TestGatherForms(TestCase):
    """Forms other torch versions / plans produce for a gather along dim 1, written with functional collectives."""

    def check(self, fn, x, gather_dim, dtype=torch.float32):
        with fake_world(WORLD):
            graphs = compile_and_capture(fn, x.to(dtype), torch.randn(16, 24, dtype=dtype), backward=False, fullgraph=True)
        graph = graphs["inference"][0]
        self.assertEqual(count_ops(graph.code, "ag_gemm"), 1)
        self.assertEqual(unfused_pairs(graph.graph), [])
        [rec] = kosmos.report().rewrites
        self.assertEqual(rec.shapes["gather_dim"], gather_dim)
        return skeleton(graph.code)

    def test_slice_cat(self):
        def fn(x, w):
            g = _gathered(x)
            s = x.shape[0]
            return torch.cat([g[r * s:(r + 1) * s] for r in range(WORLD)], dim=1) @ w

        out = self.check(fn, torch.randn(2, 3, 16), 1)
        self.assertExpectedInline(out, """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2], [None], 1, 4, '0', False)
t3 = t0[0]""")

    def test_narrow_cat(self):
        def fn(x, w):
            g = _gathered(x)
            s = x.shape[0]
            return torch.cat([g.narrow(0, r * s, s) for r in range(WORLD)], dim=1) @ w

        self.check(fn, torch.randn(2, 3, 16), 1)

    def test_chunk_cat_fp16(self):
        def fn(x, w):
            return torch.cat(torch.chunk(_gathered(x), WORLD, 0), dim=1) @ w

        self.check(fn, torch.randn(2, 3, 16), 1, dtype=torch.float16)

    def test_reshape_only_gather_of_batch_1(self):
        def fn(x, w):
            return _gathered(x).view(1, WORLD * 3, 16) @ w

        self.check(fn, torch.randn(1, 3, 16), 0)


class TestNegative(TestCase):
    def test_weight_depends_on_gathered(self):
        from graph_capture import fake_world

        def fn(x):
            g = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, WORLD, "0"))
            w = g[:16, :16].t()  # the weight is a slice of the gathered tensor itself
            return g @ w

        with fake_world(WORLD):
            graphs = compile_and_capture(fn, torch.randn(8, 16), backward=False)
        code = graphs["inference"][0].code
        self.assertEqual(count_ops(code, "ag_gemm"), 0)
        [rec] = kosmos.report().left_alone
        self.assertRegex(rec.reason, r"the operand .* depends on the gathered tensor")

    def test_gathered_rows_in_other_order(self):
        def fn(x):
            g = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, WORLD, "0"))
            return g.flip(0) @ torch.ones(16, 8)

        with fake_world(WORLD):
            compile_and_capture(fn, torch.randn(8, 16), backward=False)
        [rec] = kosmos.report().left_alone
        self.assertEqual(rec.reason, "no matmul reads the gathered rows as its left operand")

    def test_gather_along_contracted_dim(self):
        def fn(x):
            g = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, WORLD, "0"))
            full = torch.cat(torch.chunk(g, WORLD, 0), dim=1)  # gathers K: not a row gather
            return full @ torch.ones(64, 8)

        with fake_world(WORLD):
            graphs = compile_and_capture(fn, torch.randn(8, 16), backward=False)
        self.assertEqual(count_ops(graphs["inference"][0].code, "ag_gemm"), 0)
        self.assertEqual(len(kosmos.report().left_alone), 1)

    def test_unreduced_output_used_elsewhere(self):
        def fn(a, w):
            y = a @ w
            rs = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(y, "sum", WORLD, "0"))
            return rs, y.relu()

        with fake_world(WORLD):
            compile_and_capture(fn, torch.randn(16, 8), torch.randn(8, 4), backward=False)
        [rec] = kosmos.report().left_alone
        self.assertTrue(rec.reason.startswith("the unreduced matmul output is also used by"), rec.reason)

    def test_reduce_op_max_left_alone(self):
        def fn(a, w):
            return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(a @ w, "max", WORLD, "0"))

        with fake_world(WORLD):
            compile_and_capture(fn, torch.randn(16, 8), torch.randn(8, 4), backward=False)
        [rec] = kosmos.report().left_alone
        self.assertEqual(rec.reason, "reduce op 'max' is not sum/avg")

    def test_all_reduce_reported_as_candidate(self):
        mesh_world = 2

        class RowTP(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(16, 32, bias=False)
                self.down = nn.Linear(32, 16, bias=False)

            def forward(self, x):
                return self.down(self.up(x).relu())

        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        with fake_world(mesh_world):
            mesh = init_device_mesh("cpu", (mesh_world,))
            m = parallelize_module(RowTP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            compile_and_capture(m, torch.randn(4, 16), backward=False)
        recs = [r for r in kosmos.report().left_alone if r.kind == "all_reduce"]
        self.assertEqual(len(recs), 1)
        self.assertIn("candidate not yet fused: mm -> all_reduce", recs[0].reason)
        self.assertEqual(kosmos.report().count(), 0)


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()
