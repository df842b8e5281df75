"""Row probes: learn how a chain of pure data-movement nodes reorders the rows of a tensor.

A TP+SP graph moves gathered (or to-be-scattered) rows around with forms that differ between torch
versions: split/getitem/cat, slice+cat, narrow, index with a constant permutation + as_strided, plain
reshapes when the local batch is 1. Rather than matching each form by its syntax, kosmos runs the
chain on a small integer "probe" — one id per row, the contracted last dim shrunk to 1 — and compares
the resulting order of ids with what a gather/scatter along a candidate dim would give.

Symbolic sizes (dynamic shapes). A probe needs concrete sizes, so a graph whose token dims are
symbols is probed at *assignments* of its symbols (`size_assignments`): the fake tensors' hints
(the sizes this graph was traced with) and a second assignment that differs in every symbol and
satisfies every guard of the shape env (so the compiled graph really runs at those sizes: for each
symbol the first of hint + W, 2 * hint, hint + 2W, 3 * hint, hint +- 1 that keeps every guard true;
a symbol a guard pins to one value stays). A layout is accepted only when the same
candidate (shape, dim) reproduces the probed order at both assignments. Why two: an order that is
a gather/scatter at one size may only coincide with it there (a constant split size equal to the
shard length at the hint, a permutation built for one length); a second admissible size with
every symbol changed exposes those. Limits: two points are evidence, not a proof: a chain whose
row order is piecewise in a symbol (e.g. a slice clamped at a constant) could agree at both
points and differ elsewhere. The chains this pass admits are index maps affine in the sizes
(view/split/cat/slice/narrow/permute/as_strided, index by a permutation built from the sizes),
for which agreement at two sizes with every symbol changed is what we rely on. Unbacked symbols
(no hint) are refused. Only token-like dims may be symbolic: the contracted (last) dim must be
static, and passes never read a hint into the graph (sizes of inserted nodes come from size nodes
already in the graph; see graph_edit.size_args).
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_DIM_OPS = {  # op -> (position of the dim argument, default dim)
    aten.split.Tensor: (2, 0),
    aten.split_with_sizes.default: (2, 0),
    aten.slice.Tensor: (1, 0),
    aten.narrow.default: (1, None),
    aten.unsqueeze.default: (1, None),
    aten.squeeze.dim: (1, None),
}
_IDENTITY = {aten.clone.default, aten.alias.default, prims.convert_element_type.default}
LAYOUT_OPS = _VIEWS | set(_DIM_OPS) | _IDENTITY | {
    operator.getitem,
    aten.cat.default,
    aten.index.Tensor,
    aten.as_strided.default,
    aten.permute.default,
}
# producers of index tensors that are safe to evaluate at compile time (no graph inputs reach them)
_CONSTANT_OK_LIMIT = 1 << 22


class ProbeError(Exception):
    """The chain cannot be probed; the message is the reason recorded for the candidate."""


def val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


Size = Union[int, sympy.Expr]  # a static size, or the sympy expression of a symbolic one


def size_expr(s) -> Optional[Size]:
    """An int / SymInt / size node as an int or a sympy expression (None if it is no size)."""
    if isinstance(s, fx.Node):
        s = s.meta.get("val")
    if isinstance(s, bool):
        return None
    if isinstance(s, int):
        return s
    if isinstance(s, torch.SymInt):
        s = s.node.expr
    if isinstance(s, sympy.Expr):
        return int(s) if s.is_Integer else s
    return None


def shape_of(node) -> Optional[list[Size]]:
    """The node's shape: ints, and sympy expressions for symbolic sizes (compared structurally, never guarded)."""
    v = val(node)
    return None if v is None else [size_expr(s) for s in v.shape]


def divisible(size: Size, k: int, shape_env=None) -> bool:
    """True if `size` is a multiple of k for every value of its symbols (decided without a guard): structurally,
    or by a divisibility the shape env already guards (e.g. Mod(s0, 4) from a split that must be even)."""
    if isinstance(size, int):
        return size % k == 0
    if sympy.Mod(size, k) == 0:
        return True
    from torch.utils._sympy.functions import Mod  # the shape env's own Mod (not sympy's) keys its facts

    if shape_env is None:
        return False
    mod = Mod(size, k)
    return mod in shape_env.divisible or shape_env.simplify(mod) == 0


def shape_env_of(nodes) -> Optional[object]:
    """The ShapeEnv behind the symbolic sizes of these nodes' fake values, if any."""
    for n in nodes:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        sizes = list(v.shape) if isinstance(v, torch.Tensor) else [v]
        for s in sizes:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


Assignment = dict  # sympy.Symbol -> int


def concrete(size, env: Assignment) -> int:
    """A size (int, SymInt, size node or sympy expression) evaluated at an assignment of its symbols."""
    e = size if isinstance(size, sympy.Expr) else size_expr(size)
    if e is None:
        raise ProbeError(f"{size} is not a size")
    if isinstance(e, int):
        return e
    try:
        return int(e.xreplace(env))
    except (TypeError, ValueError) as err:
        raise ProbeError(f"cannot evaluate the size {e} at {env}: {err}") from err


def _backed_values(shape_env) -> dict:
    return dict(getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)


def _admissible(shape_env, env: Assignment) -> bool:
    for sym, value in env.items():
        vr = shape_env.var_to_range.get(sym)
        if vr is not None and not (vr.lower <= value <= vr.upper):
            return False
    exprs = [g.expr for g in shape_env.guards]
    exprs += [ra.expr for ras in shape_env.deferred_runtime_asserts.values() for ra in ras]
    for e in exprs:
        try:
            if e.xreplace(env) is not sympy.true:
                return False
        except (TypeError, ValueError, ZeroDivisionError):
            return False
    return True


def size_assignments(sizes: list[Size], world_size: int, shape_env) -> list[Assignment]:
    """Assignments of the symbols in `sizes` to probe at: [{}] if there are none, else [hints, second].

    The second assignment changes every symbol of `sizes` that its range lets change (first of
    h + W, 2h, h + 2W, 3h, h + 1, h - 1, chosen symbol by symbol) and satisfies every guard and
    runtime assert of the shape env (see the module docstring); ProbeError if a symbol has no hint or
    no second assignment is found."""
    syms = set()
    for s in sizes:
        if isinstance(s, sympy.Expr):
            syms |= s.free_symbols
    if not syms:
        return [{}]
    if shape_env is None:
        raise ProbeError("symbolic sizes without a shape env")
    hints = {k: int(v) for k, v in _backed_values(shape_env).items()}
    missing = sorted(str(s) for s in syms if s not in hints)
    if missing:
        raise ProbeError(f"symbolic size(s) {', '.join(missing)} have no hint (data-dependent)")
    W = max(world_size, 2)
    second = dict(hints)
    for sym in sorted(syms, key=str):
        h = hints[sym]
        vr = shape_env.var_to_range.get(sym)
        if vr is not None and vr.lower == vr.upper:
            continue  # pinned to one value by a guard: it cannot take another
        for value in (h + W, 2 * h, h + 2 * W, 3 * h, h + 1, h - 1):
            if value >= 0 and value != h and _admissible(shape_env, {**second, sym: value}):
                second[sym] = value
                break
        else:
            raise ProbeError(f"no second admissible value of the symbolic size {sym} (hint {h}) to confirm the layout")
    return [hints, second]


def is_layout_node(node: fx.Node, last_dim: int) -> bool:
    """True if `node` moves whole rows of its first input around and keeps the last dim (size `last_dim`)."""
    if node.op != "call_function" or node.target not in LAYOUT_OPS:
        return False
    multi = node.target in (aten.split.Tensor, aten.split_with_sizes.default)
    shape = shape_of(node.args[0]) if multi else shape_of(node)
    if shape is None or not shape or shape[-1] != last_dim:
        return False
    if node.target is aten.permute.default:
        dims = list(node.args[1])
        return dims[-1] in (-1, len(dims) - 1)
    if node.target in _DIM_OPS:
        pos, default = _DIM_OPS[node.target]
        dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
        src = shape_of(node.args[0])
        if not isinstance(dim, int) or src is None:
            return False
        nd = len(src) if node.target is not aten.unsqueeze.default else len(src) + 1
        return dim % nd != nd - 1
    if node.target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return dim % len(shape) != len(shape) - 1
    if node.target is aten.index.Tensor:
        idx = list(node.args[1])
        src = shape_of(node.args[0])
        return src is not None and len(idx) < len(src) and all(isinstance(i, fx.Node) or i is None for i in idx)
    if node.target is aten.as_strided.default:
        size = [size_expr(x) for x in node.args[1]]
        stride = [size_expr(x) for x in node.args[2]]
        offset = size_expr(node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0)
        if any(x is None for x in size + stride) or offset is None:
            return False
        k = last_dim
        return stride[-1] == 1 and all(divisible(s, k) for s in stride[:-1]) and divisible(offset, k) and size[-1] == k
    return True


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs of a layout node that carry rows (the first arg, or every tensor of a cat)."""
    if node.target is aten.cat.default:
        return list(node.args[0])
    return [node.args[0]]


class Prober:
    """Evaluates layout chains on row-id probes (last dim shrunk to 1) and constant index subgraphs."""

    def __init__(self, last_dim: int, env: Optional[Assignment] = None):
        self.k = last_dim
        self.env = env or {}  # the values of the graph's size symbols to probe at
        self.values: dict[fx.Node, object] = {}

    def seed(self, node: fx.Node, probe: torch.Tensor) -> None:
        self.values[node] = probe

    def run(self, node: fx.Node):
        if node in self.values:
            return self.values[node]
        if size_expr(node) is not None:  # a size node (placeholder or SymInt arithmetic)
            out = concrete(node, self.env)
        elif node.target in LAYOUT_OPS and node.args and isinstance(node.args[0], (fx.Node, list, tuple)):
            out = self._layout(node)
        else:
            out = self._constant(node)
        self.values[node] = out
        return out

    def _arg(self, a):
        if isinstance(a, fx.Node):
            return self.run(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self._arg(x) for x in a)
        return a

    def _layout(self, node: fx.Node):
        t = node.target
        if t is operator.getitem:
            return self.run(node.args[0])[node.args[1]]
        if t is aten.cat.default:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            return torch.cat([self.run(x) for x in node.args[0]], dim)
        x = self.run(node.args[0])
        if t in _IDENTITY:
            return x
        if t in _VIEWS:
            shape = [self._arg(s) for s in node.args[1]]
            if shape[-1] not in (self.k, -1):
                raise ProbeError(f"{node.name} reshapes the contracted dim")
            return x.reshape(shape[:-1] + [1])
        if t is aten.index.Tensor:
            idx = [self.run(i) if isinstance(i, fx.Node) else None for i in node.args[1]]
            return x[tuple(idx)]
        if t is aten.as_strided.default:
            size, stride = self._arg(list(node.args[1])), self._arg(list(node.args[2]))
            offset = self._arg(node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0)
            if not _contiguous_base(val(node.args[0])):
                raise ProbeError(f"{node.name} restrides a tensor that is not a contiguous base")
            k = self.k
            return torch.as_strided(
                x.contiguous(), size[:-1] + [1], [s // k for s in stride[:-1]] + [1], offset // k
            )
        args = [self._arg(a) for a in node.args[1:]]
        return t(x, *args, **{k: self._arg(a) for k, a in node.kwargs.items()})

    def _constant(self, node: fx.Node):
        """Evaluates a node that no graph input reaches (e.g. iota/sort building an index permutation)."""
        if node.op != "call_function":
            raise ProbeError(f"{node.name} ({node.op}) is not a compile-time constant")
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and concrete(v.numel(), self.env) > _CONSTANT_OK_LIMIT:
            raise ProbeError(f"{node.name} is too large to evaluate at compile time")
        args = self._arg(list(node.args))
        kwargs = {k: self._arg(a) for k, a in node.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        try:
            return node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure means "not a constant we understand"
            raise ProbeError(f"cannot evaluate {node.name} at compile time: {e}") from e


def _contiguous_base(v) -> bool:
    """v is contiguous from storage offset 0, decided structurally (no guard on symbolic sizes)."""
    if v is None or size_expr(v.storage_offset()) != 0:
        return False
    expected = 1
    for size, stride in reversed(list(zip(v.shape, v.stride()))):
        size, stride = size_expr(size), size_expr(stride)
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return True


def row_ids(shape_without_last: list[int]) -> torch.Tensor:
    n = 1
    for s in shape_without_last:
        n *= s
    return torch.arange(n, dtype=torch.int64).reshape(list(shape_without_last) + [1])


def gathered_order(shard_shape: list[int], gather_dim: int, world_size: int) -> torch.Tensor:
    """Row ids of cat([shard of rank r], gather_dim) where rank r's rows are ids r*R .. (r+1)*R-1."""
    lead = shard_shape[:-1]
    rows = row_ids(lead).reshape(lead)
    per_rank = rows.numel()
    return torch.cat([rows + r * per_rank for r in range(world_size)], dim=gather_dim).flatten()


def scattered_order(full_shape: list[int], scatter_dim: int, world_size: int) -> torch.Tensor:
    """Row ids, in reduce-scatter input order, of chunk r (for r = 0..W-1) of the full tensor along scatter_dim."""
    lead = full_shape[:-1]
    rows = row_ids(lead).reshape(lead)
    return torch.cat([c.flatten() for c in torch.chunk(rows, world_size, dim=scatter_dim)])
