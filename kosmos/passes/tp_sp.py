"""TP+SP post-grad pass: all_gather -> matmul becomes kosmos::ag_gemm, matmul -> reduce_scatter kosmos::gemm_rs.

Matching (`find_*`) is kept apart from rewriting (`*Match.replace`): finders return matches or
records of why a candidate was left alone; the rewrite step only edits the graph.

Dynamic shapes: token dims (batch, sequence) may be symbolic; the contracted dims and the weights
must be static. The layout of a symbolic chain is probed at two admissible assignments of the
symbols and accepted only if both give the same (shape, dim) (layout_probe's docstring says why and
what that does not prove). Rewrites never specialize: inserted reshapes take symbolic sizes from
size nodes already in the graph (graph_edit.size_args), and no guard is added: shapes are compared
as sympy expressions, divisibility is decided structurally, never by evaluating a SymBool.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Union

import sympy
import torch
import torch.fx as fx

from kosmos.reporting import PassRecord, record
from kosmos.ops import dispatch
from kosmos.options import KosmosOptions
from kosmos.passes import graph_edit
from kosmos.passes.layout_probe import (
    ProbeError,
    Prober,
    concrete,
    divisible,
    gathered_order,
    is_layout_node,
    row_ids,
    scattered_order,
    shape_env_of,
    shape_of,
    size_assignments,
    tensor_inputs,
    val,
)

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_CAST = torch.ops.prims.convert_element_type.default
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass
class MatmulUse:
    """A matmul reading the gathered rows as its left operand: mm(A, W), addmm(b, A, W) or bmm(A, expand(W))."""

    node: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]


@dataclasses.dataclass
class AllGatherMatch:
    collective: fx.Node
    waits: list[fx.Node]
    shard: fx.Node  # the all-gather's input
    shard_view: fx.Node  # the shard or a node it is a view of: the gather is a cat of it along gather_dim
    shard_shape: list  # shard_view's shape (ints, sympy expressions for symbolic sizes)
    gather_dim: int
    world_size: int
    group_name: str
    chain: list[fx.Node]  # layout nodes between the waits and the matmuls (all ends read rows in one order)
    matmuls: list[MatmulUse]
    served: list[fx.Node]  # other chain ends, rebuilt as views of the returned gathered tensor
    cast_to: Optional[torch.dtype]  # dtype cast inside the chain, moved before the gather

    def replace(self, graph: fx.Graph) -> fx.Node:
        pos = graph_edit.positions(graph)
        users = [m.node for m in self.matmuls] + [u for s in self.served for u in s.users]
        anchor = min(users, key=pos.__getitem__)
        for m in self.matmuls:
            for inp in (m.weight, m.bias):
                if inp is not None:
                    graph_edit.hoist_before(inp, anchor, pos)
        sizes = {n: graph_edit.size_args(shape_of(n), anchor, pos, hoist=True, replaced=self._reshaped())
                 for n in self._reshaped()}
        with graph.inserting_before(anchor):
            a = self.shard_view
            if self.cast_to is not None:
                a = graph_edit.call(graph, _CAST, (a, self.cast_to))
            fused = graph_edit.call(
                graph,
                torch.ops.kosmos.ag_gemm.default,
                (
                    a,
                    [m.weight for m in self.matmuls],
                    [m.bias for m in self.matmuls],
                    self.gather_dim,
                    self.world_size,
                    self.group_name,
                    bool(self.served),
                ),
            )
            outs = [
                graph_edit.call(graph, operator.getitem, (fused, i), like=[fused])
                for i in range(len(self.matmuls) + bool(self.served))
            ]
            for m, out in zip(self.matmuls, outs):
                m.node.replace_all_uses_with(graph_edit.call(graph, aten.reshape.default, (out, sizes[m.node])))
            for s in self.served:
                s.replace_all_uses_with(graph_edit.call(graph, aten.reshape.default, (outs[-1], sizes[s])))
        graph_edit.erase_unused([m.node for m in self.matmuls] + self.chain[::-1] + self.waits + [self.collective])
        return fused

    def _reshaped(self) -> list[fx.Node]:
        """Nodes the rewrite replaces by reshapes of the op's outputs."""
        return [m.node for m in self.matmuls] + list(self.served)

    def anchor(self) -> fx.Node:
        pos = graph_edit.positions(self.collective.graph)
        return min([m.node for m in self.matmuls] + [u for s in self.served for u in s.users], key=pos.__getitem__)


@dataclasses.dataclass
class ReduceScatterMatch:
    collective: fx.Node
    waits: list[fx.Node]
    matmuls: list[fx.Node]  # mm / addmm nodes whose outputs are summed and scattered
    inputs: list[fx.Node]
    weights: list[fx.Node]
    bias: Optional[fx.Node]
    out_dtype: Optional[torch.dtype]  # each matmul term is cast to this before the sum
    full_shape: list  # the summed matmul output viewed so that the scatter is a chunk along scatter_dim
    scatter_dim: int
    reduce_op: str
    world_size: int
    group_name: str
    chain: list[fx.Node]  # nodes between the matmuls and the collective (views, adds, split/cat)

    def replace(self, graph: fx.Graph) -> fx.Node:
        pos = graph_edit.positions(graph)
        lead, out_shape = self.reshapes()
        lead = graph_edit.size_args(lead, self.collective, pos, hoist=True, replaced=self.waits)
        out_sizes = graph_edit.size_args(out_shape, self.collective, pos, hoist=True, replaced=self.waits)
        with graph.inserting_before(self.collective):
            inputs = [
                graph_edit.call(graph, aten.reshape.default, (x, lead + [shape_of(x)[-1]])) for x in self.inputs
            ]
            fused = graph_edit.call(
                graph,
                torch.ops.kosmos.gemm_rs.default,
                (
                    inputs,
                    list(self.weights),
                    self.bias,
                    self.scatter_dim,
                    self.reduce_op,
                    self.world_size,
                    self.group_name,
                    self.out_dtype,
                ),
            )
            out = graph_edit.call(graph, aten.reshape.default, (fused, out_sizes))
        for w in self.waits:
            w.replace_all_uses_with(out)
        graph_edit.erase_unused(self.waits + [self.collective] + self.chain[::-1] + self.matmuls)
        return fused

    def reshapes(self) -> tuple[list, list]:
        """The inputs' leading shape and the output shape the rewrite reshapes to."""
        return self.full_shape[:-1], shape_of(self.waits[0])


@dataclasses.dataclass
class LeftAlone:
    kind: str
    reason: str
    nodes: tuple[str, ...]
    shapes: dict = dataclasses.field(default_factory=dict)


Finding = Union[AllGatherMatch, ReduceScatterMatch, LeftAlone]


# ----------------------------------------------------------------------------------------- matching


def _matmul_use(user: fx.Node, rows: fx.Node) -> Optional[MatmulUse]:
    if user.target is aten.mm.default and user.args[0] is rows and user.args[1] is not rows:
        return MatmulUse(user, user.args[1], None)
    if (
        user.target is aten.addmm.default
        and user.args[1] is rows
        and user.kwargs.get("beta", 1) == 1
        and user.kwargs.get("alpha", 1) == 1
        and val(user.args[0]) is not None
        and val(user.args[0]).dim() == 1
    ):
        return MatmulUse(user, user.args[2], user.args[0])
    if user.target is aten.bmm.default and user.args[0] is rows:
        w = user.args[1]
        if w.target is aten.expand.default and val(w.args[0]) is not None and val(w.args[0]).dim() == 2:
            return MatmulUse(user, w.args[0], None)
    return None


def _chain_from(start: fx.Node, last_dim: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """Layout nodes reachable from `start` (in graph order) and the chain ends (nodes with outside users)."""
    chain, ends, seen = [], [], {start}
    stack = [start]
    while stack:
        n = stack.pop()
        outside = False
        for u in n.users:
            if u in seen:
                continue
            if is_layout_node(u, last_dim) and all(i in seen for i in tensor_inputs(u)):
                seen.add(u)
                chain.append(u)
                stack.append(u)
            elif is_layout_node(u, last_dim) and u.target is aten.cat.default:
                continue  # a cat whose other inputs are not reached yet; revisited from them
            else:
                outside = True
        if outside:
            ends.append(n)
    return chain, ends


def _candidate_views(node: fx.Node, last_dim: int) -> list[tuple[fx.Node, list]]:
    """The node and the nodes it is a view of (where the sharded dim may still be visible), with their shapes."""
    views, n = [], node
    while n is not None and shape_of(n) is not None and shape_of(n)[-1] == last_dim:
        views.append((n, shape_of(n)))
        if n.op == "call_function" and n.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            n = n.args[0]
        else:
            n = None
    return views


def _find_gather_layout(views, world_size, observed: list[torch.Tensor], envs) -> Optional[tuple[int, int]]:
    """The first (view index, dim) whose gather order is the observed order at every assignment."""
    for i, (_, shape) in enumerate(views):
        for dim in range(len(shape) - 1):
            if all(_same(gathered_order([concrete(s, env) for s in shape], dim, world_size), obs)
                   for env, obs in zip(envs, observed)):
                return i, dim
    return None


def _same(expected: torch.Tensor, observed: torch.Tensor) -> bool:
    return expected.shape == observed.shape and torch.equal(expected, observed)


def _symbolic(shape) -> list[str]:
    return [str(s) for s in shape if not isinstance(s, int)]


def _static_weights(operands) -> Optional[str]:
    """Why one of the (matmul, weight, bias) operands has a symbolic or unknown shape, or None."""
    for node, weight, bias in operands:
        for inp in (weight, bias):
            if inp is not None and _symbolic(shape_of(inp) or ["?"]):
                return f"the operand {inp.name} of {node.name} has symbolic or unknown shape {shape_of(inp)}"
    return None


def _waits(collective: fx.Node) -> Optional[list[fx.Node]]:
    """The wait_tensor nodes of a collective (torch 2.14 gives each consumer a wait of its own)."""
    users = list(collective.users)
    if users and all(u.target is c10d.wait_tensor.default for u in users):
        return users
    return None


def find_all_gather(collective: fx.Node) -> Optional[Finding]:
    shard, world_size, group_name = collective.args[0], collective.args[1], collective.args[2]
    waits = _waits(collective)
    names = (collective.name,)
    if waits is None:
        return LeftAlone("ag_gemm", "all-gather result is used without wait_tensor", names)
    shape = shape_of(waits[0])
    if shape is None or shape_of(shard) is None:
        return LeftAlone("ag_gemm", "no fake tensor value (shape unknown)", names)
    if len(shape) < 2:
        return LeftAlone("ag_gemm", "1-D all-gather (no rows to feed a matmul)", names)
    k = shape[-1]
    if not isinstance(k, int):
        return LeftAlone("ag_gemm", f"the hidden (last) dim of the gathered tensor is symbolic ({k})", names)
    chain, ends = [], []
    for w in waits:
        c, e = _chain_from(w, k)
        chain += c
        ends += e
    uses = [(e, m) for e in ends for m in (_matmul_use(u, e) for u in e.users) if m is not None]
    names = (collective.name,) + tuple(w.name for w in waits) + tuple(n.name for n in chain)
    if not uses:
        return LeftAlone("ag_gemm", "no matmul reads the gathered rows as its left operand", names, {"gathered": shape})
    matmuls = [m for _, m in uses]
    rows = uses[0][0]
    source = set(chain) | set(waits)
    pos = graph_edit.positions(collective.graph)
    for m in matmuls:
        for inp in (m.weight, m.bias):
            if inp is not None and graph_edit.depends_on(inp, source, 0, pos):
                return LeftAlone("ag_gemm", f"the operand {inp.name} of {m.node.name} depends on the gathered tensor",
                                 names)
    bad = _static_weights((m.node, m.weight, m.bias) for m in matmuls)
    if bad:
        return LeftAlone("ag_gemm", bad, names)
    dtype = val(rows).dtype
    if dtype not in _SUPPORTED_DTYPES:
        return LeftAlone("ag_gemm", f"unsupported dtype {dtype}", names)
    if any(val(m.weight).dtype != dtype for m in matmuls):
        return LeftAlone("ag_gemm", "matmul operands have different dtypes", names)
    casts = [n for n in chain if n.target is _CAST]
    if len({n.args[1] for n in casts}) > 1:
        return LeftAlone("ag_gemm", "several dtype casts between gather and matmul", names)
    matmul_nodes = {m.node for m in matmuls}
    served = [e for e in dict.fromkeys(ends) if any(u not in matmul_nodes for u in e.users)]
    views = _candidate_views(shard, k)
    ends = list(dict.fromkeys([r for r, _ in uses] + served))
    for e in ends:
        if val(e).dtype != dtype:
            return LeftAlone("ag_gemm", f"gathered tensor is also used as {val(e).dtype} ({e.name})", names)
    sizes = shape + [s for _, v in views for s in v] + [s for e in ends for s in shape_of(e)]
    try:
        envs = size_assignments(sizes, world_size, shape_env_of([waits[0], shard]))
        observed = []
        for env in envs:
            prober = Prober(k, env)
            for w in waits:
                prober.seed(w, row_ids([concrete(s, env) for s in shape[:-1]]))
            observed.append(prober.run(rows).flatten())
            for e in ends:
                if not torch.equal(prober.run(e).flatten(), observed[-1]):
                    return LeftAlone("ag_gemm", f"{e.name} uses the gathered rows in another order than {rows.name}",
                                     names)
    except ProbeError as e:
        return LeftAlone("ag_gemm", str(e), names)
    layout = _find_gather_layout(views, world_size, observed, envs)
    if layout is None:
        why = " (at the hints and at a second admissible size)" if len(envs) > 1 else ""
        return LeftAlone("ag_gemm", "the matmul reads the gathered rows in an order that is no gather "
                         f"along a dim{why}", names)
    view, view_shape = views[layout[0]]
    match = AllGatherMatch(
        collective, waits, shard, view, view_shape, layout[1], world_size, group_name, chain, matmuls, served,
        dtype if casts else None,
    )
    pos = graph_edit.positions(collective.graph)
    for n in match._reshaped():
        if graph_edit.size_args(shape_of(n), match.anchor(), pos, replaced=match._reshaped()) is None:
            return LeftAlone("ag_gemm", f"no size nodes in the graph give the symbolic shape {shape_of(n)} of {n.name}",
                             names)
    return match


@dataclasses.dataclass
class _Term:
    matmul: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    cast: Optional[torch.dtype]


_VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _sum_terms(node: fx.Node, chain: list[fx.Node], cast=None) -> Optional[list[_Term]]:
    """The matmul terms that `node` sums (each maybe reshaped and cast to one dtype), or None.

    Accepted: mm, addmm (1-D bias, or a same-shape summand that Inductor folded in), views, adds of
    same-shape summands, and one dtype cast per term with no add below it (so the op's semantics,
    each term cast then summed, are exactly the graph's)."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is aten.mm.default:
        return [_Term(node, node.args[0], node.args[1], None, cast)]
    if t is aten.addmm.default:
        if node.kwargs:
            return None
        inp, a, w = node.args
        if val(inp) is not None and val(inp).dim() == 1:
            return [_Term(node, a, w, inp, cast)]
        if shape_of(inp) == shape_of(node) and cast is None:
            rest = _sum_terms(inp, chain)
            return None if rest is None else [_Term(node, a, w, None, None)] + rest
        return None
    if t in _VIEW_OPS:
        chain.append(node)
        return _sum_terms(node.args[0], chain, cast)
    if t is _CAST and cast is None:
        chain.append(node)
        return _sum_terms(node.args[0], chain, node.args[1])
    if t is aten.add.Tensor and cast is None and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args):
        if shape_of(node.args[0]) != shape_of(node.args[1]):
            return None
        chain.append(node)
        parts = [_sum_terms(a, chain) for a in node.args]
        return None if any(p is None for p in parts) else parts[0] + parts[1]
    return None


def find_reduce_scatter(collective: fx.Node) -> Optional[Finding]:
    x, reduce_op, world_size, group_name = collective.args[:4]
    waits = _waits(collective)
    names = (collective.name,)
    if waits is None:
        return LeftAlone("gemm_rs", "reduce-scatter result is used without wait_tensor", names)
    shape = shape_of(x)
    if shape is None or shape_of(waits[0]) is None:
        return LeftAlone("gemm_rs", "no fake tensor value (shape unknown)", names)
    if reduce_op not in ("sum", "avg"):
        return LeftAlone("gemm_rs", f"reduce op {reduce_op!r} is not sum/avg", names)
    n = shape[-1]
    if not isinstance(n, int):
        return LeftAlone("gemm_rs", f"the hidden (last) dim of the reduce-scattered tensor is symbolic ({n})", names)
    # walk up through layout nodes to the node that sums matmul outputs
    chain, frontier, root = [], [x], None
    while frontier:
        node = frontier.pop()
        if node.op == "call_function" and is_layout_node(node, n):
            chain.append(node)
            frontier.extend(tensor_inputs(node))
            continue
        if root is not None and node is not root:
            return LeftAlone("gemm_rs", "the scattered tensor comes from several sources", names)
        root = node
    sum_chain: list[fx.Node] = []
    terms = _sum_terms(root, sum_chain) if root is not None else None
    names = (collective.name,) + tuple(c.name for c in chain)
    if not terms:
        return LeftAlone("gemm_rs", "the reduce-scattered tensor is not a sum of matmul outputs", names)
    matmuls = [t.matmul for t in terms]
    inner = set(chain) | set(sum_chain) | set(matmuls) | {collective}
    for node in chain + sum_chain + matmuls:
        if any(u not in inner for u in node.users):
            other = next(u for u in node.users if u not in inner)
            return LeftAlone("gemm_rs", f"the unreduced matmul output is also used by {other.name}", names)
    casts = {t.cast for t in terms}
    if len(casts) > 1:
        return LeftAlone("gemm_rs", "matmul terms are cast to different dtypes", names)
    biased = [t for t in terms if t.bias is not None]
    if len(biased) > 1:
        return LeftAlone("gemm_rs", "more than one bias", names)
    terms = biased + [t for t in terms if t.bias is None]  # the op adds the bias to its first term
    inputs = [t.input for t in terms]
    weights = [t.weight for t in terms]
    dtypes = {val(x).dtype for x in inputs + weights}
    if len(dtypes) > 1 or not dtypes <= set(_SUPPORTED_DTYPES):
        return LeftAlone("gemm_rs", f"unsupported or mixed dtypes {sorted(map(str, dtypes))}", names)
    bad = _static_weights((t.matmul, t.weight, t.bias) for t in terms)
    if bad:
        return LeftAlone("gemm_rs", bad, names)
    for t in terms:
        if not isinstance(shape_of(t.input)[-1], int):
            return LeftAlone("gemm_rs", f"the contracted dim of {t.matmul.name} is symbolic ({shape_of(t.input)[-1]})",
                             names)
    root_shape = shape_of(root)
    mm_rows = shape_of(matmuls[0])[0]
    candidates = [s for s in [shape_of(c) for c in chain if c.target is not operator.getitem] if s and s[-1] == n]
    candidates = [root_shape] + candidates + [[mm_rows, n]]
    try:
        envs = size_assignments([s for c in candidates for s in c] + shape_of(waits[0]), world_size,
                                shape_env_of([x, root]))
        observed = []
        for env in envs:
            prober = Prober(n, env)
            prober.seed(root, row_ids([concrete(s, env) for s in root_shape[:-1]]))
            observed.append(prober.run(x).flatten())
    except ProbeError as e:
        return LeftAlone("gemm_rs", str(e), names)
    pos = graph_edit.positions(collective.graph)
    for full in candidates:
        if sympy.expand(_numel(full) - _numel(root_shape)) != 0:
            continue
        for dim in range(len(full) - 1):
            if not divisible(full[dim], world_size, shape_env_of([x, root])):
                continue  # (a symbolic size counts only if it divides for every value the graph admits)
            if all(_same(scattered_order([concrete(s, env) for s in full], dim, world_size), obs)
                   for env, obs in zip(envs, observed)):
                match = ReduceScatterMatch(
                    collective, waits, matmuls, inputs, weights, biased[0].bias if biased else None,
                    casts.pop(), full, dim, reduce_op, world_size, group_name, chain + sum_chain,
                )
                for shp in match.reshapes():
                    if graph_edit.size_args(shp, collective, pos, replaced=waits) is None:
                        return LeftAlone("gemm_rs", f"no size nodes in the graph give the symbolic shape {shp}", names)
                return match
    why = " (at the hints and at a second admissible size)" if len(envs) > 1 else ""
    return LeftAlone("gemm_rs", f"the matmul output reaches the reduce-scatter in an order that is no chunking{why}",
                     names)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def find_all_reduce(collective: fx.Node) -> Optional[Finding]:
    """mm -> all_reduce (plain TP without SP, e.g. HF's own tp_plan): reported, not fused yet."""
    x = collective.args[0]
    while x.op == "call_function" and x.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        x = x.args[0]
    if x.target in (aten.mm.default, aten.addmm.default):
        return LeftAlone(
            "all_reduce",
            "candidate not yet fused: mm -> all_reduce (TP without sequence parallelism)",
            (x.name, collective.name),
            {"out": _printable(shape_of(x))},
        )
    return None


_FINDERS = {
    c10d.all_gather_into_tensor.default: find_all_gather,
    c10d.reduce_scatter_tensor.default: find_reduce_scatter,
    c10d.all_reduce.default: find_all_reduce,
}


def collectives(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _FINDERS]


def find(collective: fx.Node) -> Optional[Finding]:
    return _FINDERS[collective.target](collective)


# ---------------------------------------------------------------------------------------- rewriting


def _printable(shape):
    """A shape for the report: ints, and strings for symbolic sizes (no SymInt leaves the pass)."""
    return None if shape is None else [s if isinstance(s, int) else str(s) for s in shape]


def _record_rewrite(kind: str, graph_name: str, fused: fx.Node, match) -> None:
    args = fused.args
    symbolic = False
    if kind == "ag_gemm":
        a, device = val(args[0]), val(args[0]).device
        shapes = {"shard": _printable(shape_of(args[0])), "gather_dim": args[3], "world": args[4]}
        shapes["weights"] = [list(val(w).shape) for w in args[1]]
        symbolic = bool(_symbolic(shape_of(args[0]))) and device.type == "cuda"  # the shape checks would guard
        why = None if symbolic else dispatch.why_reference(
            "ag_gemm", device, a, [val(w) for w in args[1]], [val(b) if b else None for b in args[2]], *args[3:])
        reason = f"all_gather -> {len(args[1])} matmul(s)" + (" + gathered tensor reused" if args[6] else "")
        if match.cast_to is not None:
            reason += f", cast to {match.cast_to} moved before the gather"
    else:
        xs = [val(x) for x in args[0]]
        device = xs[0].device
        shapes = {"inputs": [_printable(shape_of(x)) for x in args[0]], "scatter_dim": args[3], "world": args[5]}
        symbolic = any(_symbolic(shape_of(x)) for x in args[0]) and device.type == "cuda"
        why = None if symbolic else dispatch.why_reference(
            "gemm_rs", device, xs, [val(w) for w in args[1]], val(args[2]) if args[2] else None, *args[3:])
        reason = f"{len(xs)} matmul(s) -> reduce_scatter({args[4]})"
    record(
        PassRecord(
            kind, graph_name, True, reason, (match.collective.name,), shapes,
            impl="per call" if symbolic else "reference" if why else "fused",
            impl_reason=("symbolic shapes: each call picks the fused or reference impl" if symbolic
                         else why or "supported"),
        )
    )


def run(graph: fx.Graph, graph_name: str, options: KosmosOptions) -> int:
    """Rewrites every safe TP+SP candidate in `graph`; returns how many were rewritten."""
    rewritten = 0
    for collective in collectives(graph):
        if collective.graph is not graph or collective not in collective.graph.nodes:
            continue  # erased by an earlier rewrite
        finding = find(collective)
        if finding is None:
            continue
        if isinstance(finding, LeftAlone):
            record(PassRecord(finding.kind, graph_name, False, finding.reason, finding.nodes, finding.shapes))
            continue
        if isinstance(finding, AllGatherMatch) and finding.cast_to is not None and not options.move_cast_before_gather:
            record(PassRecord("ag_gemm", graph_name, False,
                              "dtype cast between gather and matmul (move_cast_before_gather=False)",
                              (finding.collective.name,)))
            continue
        kind = "ag_gemm" if isinstance(finding, AllGatherMatch) else "gemm_rs"
        fused = finding.replace(graph)
        _record_rewrite(kind, graph_name, fused, finding)
        rewritten += 1
    if rewritten:
        graph.lint()
    return rewritten
