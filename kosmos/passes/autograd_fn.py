"""What an autograd.Function that Dynamo traced (`higher_order.autograd_function_apply`) does to its one tensor
input in each direction: pass it through, sum it over a process group, or wait for a collective's result.
Expert-parallel code wraps its collectives in such functions (transformers' `_AllReduceForward` /
`_AllReduceBackward`; on torch 2.11 `funcol.all_to_all_single_autograd` waits inside `_FromTorchTensor`); the MoE
passes read them here.

    kind = autograd_fn_kind(node)      # ("identity", "all_reduce", "3") or None when it is anything else

The bodies are `fwd_body` / `bwd_body` submodules of the owning GraphModule. A body counts as "identity" when its
output is its input behind nothing but views (`view_as`, `view`, `contiguous`), as "wait" when it is
`wait_tensor(x)`, and as "all_reduce" when it does exactly `x.copy_(wait_tensor(all_reduce(x, "sum", group)))`
(functional collectives' in-place all-reduce) and returns x (or a view of it). Grad-mode toggles are allowed
anywhere; any other op makes it None.

Besides the tensor, the function may take sizes (SymInts: Dynamo lifts the data-dependent sizes of the tensor's
shape into the bodies). The body placeholders that are not the tensor (or its gradient) may be saved or returned
but not computed with.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from kosmos.passes.moe import _val, op_name

_VIEWS = ("view_as", "view", "contiguous")
_NEUTRAL = ("_set_grad_enabled",)


def _body(node: fx.Node, index: int) -> Optional[fx.Graph]:
    body = node.args[index] if len(node.args) > index else None
    gm = node.graph.owning_module
    if not isinstance(body, fx.Node) or body.op != "get_attr" or gm is None:
        return None
    sub = getattr(gm, body.target, None)
    return sub.graph if isinstance(sub, fx.GraphModule) else None


def _output(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op == "output")


def _first_output(graph: fx.Graph) -> Optional[fx.Node]:
    """The forward body's result: the first leaf of its (outputs, saved) tuples."""
    out = _output(graph).args[0]
    while isinstance(out, (tuple, list)):
        if not out:
            return None
        out = out[0]
    return out if isinstance(out, fx.Node) else None


def _output_at(graph: fx.Graph, index: int) -> Optional[fx.Node]:
    """The backward body's gradient for the function's input `index` (it returns one per input)."""
    grads = _output(graph).args[0]
    if not isinstance(grads, (tuple, list)) or len(grads) <= index:
        return None
    grad = grads[index]
    return grad if isinstance(grad, fx.Node) else None


def _data_placeholder(graph: fx.Graph, index: int) -> Optional[fx.Node]:
    """The placeholder at `index`, if no other placeholder is computed with. The others are sizes, saved values, or
    (torch 2.11, which also returns the forward body's intermediates) gradients of outputs the backward ignores."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if index >= len(placeholders):
        return None
    output = _output(graph)
    if any(set(p.users) - {output} for i, p in enumerate(placeholders) if i != index):
        return None
    return placeholders[index]


def _strip_views(node):
    while op_name(node) in _VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _is_view_of(node, base) -> bool:
    """node is base, or base behind views (a view of a copy made on the way does not count)."""
    while node is not base:
        if op_name(node) not in _VIEWS or not isinstance(node.args[0], fx.Node):
            return False
        node = node.args[0]
    return True


def _body_kind(graph: fx.Graph, data: fx.Node, out: fx.Node) -> Optional[tuple[str, Optional[str]]]:
    """("identity", None), ("wait", None) or ("all_reduce", group_name) for a body that turns `data` into `out`."""
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method") and op_name(n) not in _NEUTRAL]
    reduces = [n for n in calls if op_name(n) == "all_reduce"]
    if not reduces:
        if all(op_name(n) in _VIEWS for n in calls) and _strip_views(out) is data:
            return "identity", None
        if calls == [out] and op_name(out) == "wait_tensor" and out.args[0] is data:
            return "wait", None
        return None
    if len(reduces) != 1:
        return None
    (ar,) = reduces
    buf = ar.args[0]
    if len(ar.args) < 3 or ar.args[1] != "sum" or _strip_views(buf) is not data:
        return None
    waits = [u for u in ar.users if op_name(u) == "wait_tensor"]
    copies = [u for w in waits for u in w.users if op_name(u) == "copy_" and u.args[0] is buf]
    if len(waits) != 1 or len(copies) != 1 or not _is_view_of(out, buf):
        return None
    allowed = set([ar] + waits + copies)
    if any(n not in allowed and op_name(n) not in _VIEWS for n in calls):
        return None
    return "all_reduce", ar.args[2]


def _tensor_input(inputs: tuple) -> Optional[int]:
    """The position of the one tensor among the function's inputs, the others being sizes; else None."""
    tensors = [i for i, a in enumerate(inputs) if isinstance(_val(a), torch.Tensor)]
    sizes = [a for a in inputs if isinstance(a, int) or isinstance(_val(a), (int, torch.SymInt))]
    return tensors[0] if len(tensors) == 1 and len(sizes) == len(inputs) - 1 else None


def tensor_input(node: fx.Node) -> Optional[fx.Node]:
    """The one tensor an `autograd_function_apply` node passes to its bodies (the other inputs being sizes)."""
    index = _tensor_input(node.args[2:])
    return None if index is None else node.args[2 + index]


def autograd_fn_kind(node: fx.Node) -> Optional[tuple[str, str, Optional[str]]]:
    """(forward kind, backward kind, group name) of an `autograd_function_apply` node with one tensor input, where
    each kind is "identity", "wait" or "all_reduce"; None for anything else (other ops, two collectives' groups)."""
    if op_name(node) != "autograd_function_apply":
        return None
    index = _tensor_input(node.args[2:])
    fwd, bwd = _body(node, 0), _body(node, 1)
    if index is None or fwd is None or bwd is None:
        return None
    fwd_in, bwd_in = _data_placeholder(fwd, index), _data_placeholder(bwd, 0)
    fwd_out, bwd_out = _first_output(fwd), _output_at(bwd, index)
    if None in (fwd_in, bwd_in, fwd_out, bwd_out):
        return None
    kinds = [_body_kind(fwd, fwd_in, fwd_out), _body_kind(bwd, bwd_in, bwd_out)]
    if any(k is None for k in kinds):
        return None
    groups = {k[1] for k in kinds if k[1] is not None}
    if len(groups) > 1:
        return None
    return kinds[0][0], kinds[1][0], next(iter(groups), None)
