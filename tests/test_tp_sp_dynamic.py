"""TP+SP pass with symbolic token dims (dynamic=True, mark_dynamic): snapshots on a fake process group,
numerics over gloo at two sequence lengths with one compile, and the refusal of a symbolic hidden dim."""
from __future__ import annotations

import operator
import re
from unittest import mock

import pytest
import torch
from expecttest import TestCase

import kosmos
from _dist import run_ranks
from graph_capture import _Capture, count_ops, fake_world, skeleton, unfused_pairs
from kosmos.passes import post_grad, tp_sp
from kosmos.passes.layout_probe import shape_env_of

WORLD = 4
_KOSMOS_OPS = (torch.ops.kosmos.ag_gemm.default, torch.ops.kosmos.gemm_rs.default)


class _GuardWatch:
    """Wraps tp_sp.run: records the shape env's guard count before and after each run of the pass."""

    def __init__(self):
        self.counts: list[tuple[int, int]] = []
        self._run = tp_sp.run

    def __call__(self, graph, graph_name, options):
        env = shape_env_of(list(graph.nodes))
        before = len(env.guards) if env is not None else 0
        out = self._run(graph, graph_name, options)
        self.counts.append((before, len(env.guards) if env is not None else 0))
        return out


def capture(fn, *args, dynamic=True, backward=True):
    """compile_and_capture with a `dynamic` flag; also returns the guard counts around the TP+SP pass."""
    torch._dynamo.reset()
    kosmos.reset_report()
    cap, watch = _Capture(), _GuardWatch()
    with torch._inductor.config.patch(post_grad_custom_post_pass=cap, fx_graph_cache=False), \
            mock.patch.object(tp_sp, "run", watch):
        out = torch.compile(fn, backend="kosmos", dynamic=dynamic, fullgraph=True)(*args)
        if backward:
            out.float().sum().backward()
    graphs = {}
    for c in cap.captured:
        graphs.setdefault(post_grad.graph_kind(c.graph), []).append(c)
    return graphs, watch.counts


def _size(s) -> str:
    return str(s.node.expr) if isinstance(s, torch.SymInt) else str(s)


def _named(text: str) -> str:
    """Symbols renamed A, B, ... in order of appearance (their numbers differ between torch versions)."""
    names: dict[str, str] = {}
    return re.sub(r"\bs\d+\b", lambda m: names.setdefault(m.group(0), "AB"[len(names)] if len(names) < 2 else f"S{len(names)}"), text)


def kosmos_shapes(graph: torch.fx.Graph) -> str:
    """Each kosmos op with the fake shapes of its tensor input(s) and outputs, and the sizes that the reshapes
    of its outputs take from the graph (a size node shown as its symbolic value)."""
    lines = []
    for n in graph.nodes:
        if n.target not in _KOSMOS_OPS:
            continue
        ins = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
        outs = n.meta["val"] if isinstance(n.meta["val"], (list, tuple)) else [n.meta["val"]]
        fmt = lambda t: "[" + ", ".join(_size(s) for s in t.shape) + "]"  # noqa: E731
        lines.append(f"{n.target.__name__.split('.')[0]}: {' '.join(fmt(i.meta['val']) for i in ins)} -> {' '.join(fmt(o) for o in outs)}")
        users = [u for g in n.users for u in ([g] if g.target is not operator.getitem else g.users)]
        for u in users:
            if u.target is torch.ops.aten.reshape.default:
                sizes = [_size(a.meta["val"]) if isinstance(a, torch.fx.Node) else str(a) for a in u.args[1]]
                lines.append(f"  reshape to [{', '.join(sizes)}]")
    return _named("\n".join(lines))


def specialized_sizes(graph: torch.fx.Graph) -> list[str]:
    """Reshapes whose size argument is a Python int where the result's size is symbolic (a specialized symbol)."""
    bad = []
    for n in graph.nodes:
        if n.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default):
            for a, s in zip(n.args[1], n.meta["val"].shape):
                if isinstance(s, torch.SymInt) and isinstance(a, int) and a != -1:
                    bad.append(f"{n.name}: {a} for {s}")
    return bad


class TestDynamicSnapshots(TestCase):
    def fused(self, name, mark=None):
        from test_tp_sp_pass import _case

        with fake_world(WORLD):
            fn, x = _case(name)
            if mark is not None:
                torch._dynamo.mark_dynamic(x, mark)
            graphs, guards = capture(fn, x, dynamic=True if mark is None else None)
        fwd, bwd = graphs["forward"][0], graphs["backward"][0]
        report = kosmos.report()
        self.assertNotIn("dynamic shapes are not fused", str(report))
        self.assertEqual([r.line() for r in report.left_alone], [])
        self.assertEqual(
            [count_ops(g.code, op) for g in (fwd, bwd) for op in ("ag_gemm", "gemm_rs")], [1, 1, 1, 1]
        )
        self.assertEqual(unfused_pairs(fwd.graph) + unfused_pairs(bwd.graph), [])
        self.assertEqual(specialized_sizes(fwd.graph) + specialized_sizes(bwd.graph), [])
        self.assertEqual(len(guards), 2)  # the pass ran on the forward and the backward graph
        self.assertTrue(all(b == a for b, a in guards), f"the pass added guards: {guards}")
        self.assertTrue(any(isinstance(s, torch.SymInt) for n in fwd.graph.nodes if n.target in _KOSMOS_OPS
                            for s in n.args[0].meta["val"].shape), "expected symbolic shapes")
        return fwd, bwd

    def test_mlp_dynamic(self):
        fwd, bwd = self.fused("mlp")
        self.assertExpectedInline(skeleton(fwd.code), """\
t0 = torch.ops.kosmos.ag_gemm.default(t1, [t2, t3], [None, None], 1, 4, '0', True)
t4 = t0[0]
t5 = t0[1]
t6 = t0[2]
t7 = torch.ops.kosmos.gemm_rs.default([t8], [t9], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(kosmos_shapes(fwd.graph), """\
ag_gemm: [A, B, 64] -> [A, 4*B, 32] [A, 4*B, 32] [A, 4*B, 64]
  reshape to [4*B*A, 32]
  reshape to [4*B*A, 32]
  reshape to [4*B*A, 64]
gemm_rs: [A, 4*B, 32] -> [A, B, 64]
  reshape to [A, B, 64]""")
        self.assertExpectedInline(kosmos_shapes(bwd.graph), """\
ag_gemm: [A, B, 64] -> [A, 4*B, 32] [A, 4*B, 64]
  reshape to [4*B*A, 32]
  reshape to [4*B*A, 64]
gemm_rs: [A, 4*B, 32] [A, 4*B, 32] -> [A, B, 64]
  reshape to [A, B, 64]""")

    def test_attention_dynamic(self):
        fwd, bwd = self.fused("attention")
        self.assertExpectedInline(skeleton(bwd.code), """\
t0 = torch.ops.kosmos.ag_gemm.default(tangents_1, [t1], [None], 1, 4, '0', True)
t2 = t0[0]
t3 = t0[1]
t4 = torch.ops.aten.mm.default(t5, t6)
t7 = torch.ops.aten.mm.default(t8, t9)
t10 = torch.ops.aten.mm.default(t11, t9)
t12 = torch.ops.aten.mm.default(t13, t9)
t14 = torch.ops.kosmos.gemm_rs.default([t15, t16, t17], [t18, t19, t20], None, 1, 'sum', 4, '0', None)""")
        self.assertExpectedInline(kosmos_shapes(fwd.graph), """\
ag_gemm: [A, B, 64] -> [A, 4*B, 16] [A, 4*B, 16] [A, 4*B, 16] [A, 4*B, 64]
  reshape to [4*B*A, 16]
  reshape to [4*B*A, 16]
  reshape to [4*B*A, 16]
  reshape to [4*B*A, 64]
gemm_rs: [A, 4*B, 16] -> [A, B, 64]
  reshape to [A, B, 64]""")
        self.assertExpectedInline(kosmos_shapes(bwd.graph), """\
ag_gemm: [A, B, 64] -> [A, 4*B, 16] [A, 4*B, 64]
  reshape to [4*B*A, 16]
  reshape to [4*B*A, 64]
gemm_rs: [A, 4*B, 16] [A, 4*B, 16] [A, 4*B, 16] -> [A, B, 64]
  reshape to [A, B, 64]""")

    def test_mlp_mark_dynamic_sequence(self):
        fwd, bwd = self.fused("mlp", mark=1)
        self.assertExpectedInline(kosmos_shapes(fwd.graph), """\
ag_gemm: [2, A, 64] -> [2, 4*A, 32] [2, 4*A, 32] [2, 4*A, 64]
  reshape to [8*A, 32]
  reshape to [8*A, 32]
  reshape to [8*A, 64]
gemm_rs: [2, 4*A, 32] -> [2, A, 64]
  reshape to [2, A, 64]""")
        self.assertExpectedInline(kosmos_shapes(bwd.graph), """\
ag_gemm: [2, A, 64] -> [2, 4*A, 32] [2, 4*A, 64]
  reshape to [8*A, 32]
  reshape to [8*A, 64]
gemm_rs: [2, 4*A, 32] [2, 4*A, 32] -> [2, A, 64]
  reshape to [2, A, 64]""")


class TestDynamicRefused(TestCase):
    def test_symbolic_hidden_dim_is_refused(self):
        c10d = torch.ops._c10d_functional

        def fn(x, w, a, v):
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, "0"))
            rs = c10d.wait_tensor(c10d.reduce_scatter_tensor(a @ v, "sum", WORLD, "0"))
            return g @ w, rs

        x, w, a, v = torch.randn(8, 16), torch.randn(16, 24), torch.randn(32, 24), torch.randn(24, 40)
        with fake_world(WORLD):
            graphs, guards = capture(fn, x, w, a, v, dynamic=True, backward=False)
        code = graphs["inference"][0].code
        self.assertEqual((count_ops(code, "ag_gemm"), count_ops(code, "gemm_rs")), (0, 0))
        reasons = sorted(_named(r.reason) for r in kosmos.report().left_alone)
        self.assertExpectedInline("\n".join(reasons), """\
the hidden (last) dim of the gathered tensor is symbolic (A)
the hidden (last) dim of the reduce-scattered tensor is symbolic (A)""")

        self.assertEqual(guards, [(guards[0][0], guards[0][0])])

    def test_layout_that_is_a_gather_only_at_the_hint_is_refused(self):
        # cat of 2-row slices of the gathered rows is the gather along dim 1 when the shard has 2 rows (the
        # hint), and not for any other row count: the second probed size must refuse it
        c10d = torch.ops._c10d_functional

        def fn(x, w):
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, "0"))
            return torch.cat([g.narrow(0, 2 * r, 2) for r in range(WORLD)], dim=1) @ w

        x, w = torch.randn(2, 3, 16), torch.randn(16, 24)
        with fake_world(WORLD):
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            graphs, _ = capture(fn, x, w, dynamic=None, backward=False)
        self.assertEqual(count_ops(graphs["inference"][0].code, "ag_gemm"), 0)
        [rec] = kosmos.report().left_alone
        self.assertExpectedInline(rec.reason, """the matmul reads the gathered rows in an order that is no gather along a dim (at the hints and at a second admissible size)""")

    def test_static_twin_of_the_hint_only_layout_is_fused(self):
        # the same chain with static sizes is a gather: the refusal above comes from the second size alone
        c10d = torch.ops._c10d_functional

        def fn(x, w):
            g = c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, "0"))
            return torch.cat([g.narrow(0, 2 * r, 2) for r in range(WORLD)], dim=1) @ w

        with fake_world(WORLD):
            graphs, _ = capture(fn, torch.randn(2, 3, 16), torch.randn(16, 24), dynamic=False, backward=False)
        self.assertEqual(count_ops(graphs["inference"][0].code, "ag_gemm"), 1)


# ------------------------------------------------------------------------------ numerics over gloo


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_two_lengths(rank, world, names, seqs):
    from kosmos.backend import kosmos_backend
    from test_tp_sp_pass import _case

    for name in names:
        torch.manual_seed(1234 + rank)
        model, _ = _case(name, world)
        params = list(model.parameters())
        compiles = []

        def counting(gm, example_inputs, **kw):
            compiles.append(gm)
            return kosmos_backend(gm, example_inputs, **kw)

        torch._dynamo.reset()
        kosmos.reset_report()
        compiled = torch.compile(model, backend=counting, dynamic=True, fullgraph=True)
        for s in seqs:
            x = torch.randn(2, s, 64, requires_grad=True)

            def step(f):
                for p in params:
                    p.grad = None
                x.grad = None
                out = f(x)
                out.float().pow(2).sum().backward()
                return [out.detach().clone(), x.grad.clone()] + [p.grad.to_local().clone() for p in params]

            eager, got = step(model), step(compiled)
            errs = [_rel(g, e) for g, e in zip(got, eager)]
            assert max(errs) <= 1e-5, f"{name} seq {s} rank {rank}: rel errors {errs}"
        report = kosmos.report()
        assert len(compiles) == 1, f"{name}: {len(compiles)} compiles for sequence lengths {seqs}"
        assert [(r.kind, r.graph) for r in report.rewrites] == [
            ("ag_gemm", "forward"), ("gemm_rs", "forward"), ("ag_gemm", "backward"), ("gemm_rs", "backward")
        ], str(report)
        assert not report.left_alone, str(report)
        assert all(k[1] == "reference" for k in report.runtime), report.runtime  # CPU: the reference impls ran
        assert sum(n for (op, _, _), n in report.runtime.items() if op == "gemm_rs") == 2 * len(seqs), report.runtime


@pytest.mark.multiproc
def test_dynamic_two_lengths_match_eager():
    # local sequence 8 and 12 per rank: 16 and 24 tokens in all; one compile serves both
    run_ranks(_check_two_lengths, 2, ["mlp", "attention"], [8, 12])


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()


def test_hf_qwen3_sequence_dynamic():
    """Unmodified HF Qwen3 under kosmos.parallelize with the sequence dim symbolic (what automatic dynamic shapes
    do when lengths vary): every forward and backward gather/scatter next to a matmul is fused. The backward's
    reduce-scatters after the split into W chunks need the shape env's guard Mod(seq, W) == 0 to see that the
    chunks are equal."""
    from torch.distributed.device_mesh import init_device_mesh

    from test_tp_sp_hf import tiny_qwen3

    with fake_world(4):
        model = kosmos.parallelize(tiny_qwen3(), init_device_mesh("cpu", (4,)))
        ids = torch.randint(0, 128, (2, 16))
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.reset()
        kosmos.reset_report()
        cap = _Capture()
        with torch._inductor.config.patch(post_grad_custom_post_pass=cap, fx_graph_cache=False):
            out = torch.compile(lambda i: model(input_ids=i).logits, backend="kosmos")(ids)
            (out.to_local() if hasattr(out, "to_local") else out).float().sum().backward()
    fwd, bwd = ([c for c in cap.captured if post_grad.graph_kind(c.graph) == k][0] for k in ("forward", "backward"))
    assert (count_ops(fwd.code, "ag_gemm"), count_ops(fwd.code, "gemm_rs")) == (5, 4)
    # static shapes give 5 reduce-scatters in backward; with a symbolic sequence one of them is traced as an
    # mm -> all_reduce (reported as a candidate, not fused)
    assert (count_ops(bwd.code, "ag_gemm"), count_ops(bwd.code, "gemm_rs")) == (4, 4)
    assert unfused_pairs(fwd.graph) + unfused_pairs(bwd.graph) == []
    assert not [r for r in kosmos.report().left_alone if "symbolic" in r.reason or "admissible" in r.reason]
