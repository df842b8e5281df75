"""Row probes: learn how a chain of pure data-movement nodes reorders the rows of a tensor.

A TP+SP graph moves gathered (or to-be-scattered) rows around with forms that differ between torch
versions: split/getitem/cat, slice+cat, narrow, index with a constant permutation + as_strided, plain
reshapes when the local batch is 1. Rather than matching each form by its syntax, kosmos runs the
chain on a small integer "probe" — one id per row, the contracted last dim shrunk to 1 — and compares
the resulting order of ids with what a gather/scatter along a candidate dim would give.
"""
from __future__ import annotations

import operator
from typing import Optional

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


def static_shape(node) -> Optional[list[int]]:
    v = val(node)
    if v is None:
        return None
    if not all(isinstance(s, int) for s in v.shape):
        return None  # symbolic sizes: never specialize them from a pass
    return list(v.shape)


def is_static(node) -> bool:
    v = val(node)
    return v is not None and all(isinstance(s, int) for s in v.shape)


def is_layout_node(node: fx.Node, last_dim: int) -> bool:
    """True if `node` moves whole rows of its first input around and keeps the last dim (size `last_dim`)."""
    if node.op != "call_function" or node.target not in LAYOUT_OPS:
        return False
    multi = node.target in (aten.split.Tensor, aten.split_with_sizes.default)
    shape = static_shape(node.args[0]) if multi else static_shape(node)
    if shape is None or not shape or shape[-1] != last_dim:
        return False
    if node.target is aten.permute.default:
        dims = list(node.args[1])
        return dims[-1] in (-1, len(dims) - 1)
    if node.target in _DIM_OPS:
        pos, default = _DIM_OPS[node.target]
        dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", default)
        src = static_shape(node.args[0])
        if dim is None or src is None:
            return False
        nd = len(src) if node.target is not aten.unsqueeze.default else len(src) + 1
        return dim % nd != nd - 1
    if node.target is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        return dim % len(shape) != len(shape) - 1
    if node.target is aten.index.Tensor:
        idx = list(node.args[1])
        src = static_shape(node.args[0])
        return src is not None and len(idx) < len(src) and all(isinstance(i, fx.Node) or i is None for i in idx)
    if node.target is aten.as_strided.default:
        size, stride = list(node.args[1]), list(node.args[2])
        offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0
        k = last_dim
        return stride[-1] == 1 and all(s % k == 0 for s in stride[:-1]) and offset % k == 0 and size[-1] == k
    return True


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs of a layout node that carry rows (the first arg, or every tensor of a cat)."""
    if node.target is aten.cat.default:
        return list(node.args[0])
    return [node.args[0]]


class Prober:
    """Evaluates layout chains on row-id probes (last dim shrunk to 1) and constant index subgraphs."""

    def __init__(self, last_dim: int):
        self.k = last_dim
        self.values: dict[fx.Node, object] = {}

    def seed(self, node: fx.Node, probe: torch.Tensor) -> None:
        self.values[node] = probe

    def run(self, node: fx.Node):
        if node in self.values:
            return self.values[node]
        if node.target in LAYOUT_OPS and node.args and isinstance(node.args[0], (fx.Node, list, tuple)):
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
            shape = list(node.args[1])
            if shape[-1] not in (self.k, -1):
                raise ProbeError(f"{node.name} reshapes the contracted dim")
            return x.reshape(shape[:-1] + [1])
        if t is aten.index.Tensor:
            idx = [self.run(i) if isinstance(i, fx.Node) else None for i in node.args[1]]
            return x[tuple(idx)]
        if t is aten.as_strided.default:
            size, stride = list(node.args[1]), list(node.args[2])
            offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset", 0) or 0
            src = val(node.args[0])
            if src is None or not src.is_contiguous() or src.storage_offset() != 0:
                raise ProbeError(f"{node.name} restrides a tensor that is not a contiguous base")
            k = self.k
            return torch.as_strided(
                x.contiguous(), size[:-1] + [1], [s // k for s in stride[:-1]] + [1], offset // k
            )
        args = [self._arg(a) for a in node.args[1:]]
        return t(x, *args, **node.kwargs)

    def _constant(self, node: fx.Node):
        """Evaluates a node that no graph input reaches (e.g. iota/sort building an index permutation)."""
        if node.op != "call_function":
            raise ProbeError(f"{node.name} ({node.op}) is not a compile-time constant")
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.numel() > _CONSTANT_OK_LIMIT:
            raise ProbeError(f"{node.name} is too large to evaluate at compile time")
        args = self._arg(list(node.args))
        kwargs = {k: self._arg(a) for k, a in node.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = torch.device("cpu")
        try:
            return node.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any failure means "not a constant we understand"
            raise ProbeError(f"cannot evaluate {node.name} at compile time: {e}") from e


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
