"""What an autograd.Function that Dynamo traced (`higher_order.autograd_function_apply`) does to its one input in
each direction: pass it through, or sum it over a process group. Expert-parallel code wraps its collectives in
such functions (transformers' `_AllReduceForward` / `_AllReduceBackward`); the MoE pass reads them here.

    kind = autograd_fn_kind(node)      # ("identity", "all_reduce", "3") or None when it is anything else

The bodies are `fwd_body` / `bwd_body` submodules of the owning GraphModule. A body counts as "identity" when its
first output is its input behind nothing but views (`view_as`, `view`, `contiguous`), and as "all_reduce" when
it does exactly `x.copy_(wait_tensor(all_reduce(x, "sum", group)))` (functional collectives' in-place
all-reduce) and returns x (or a view of it). Grad-mode toggles are allowed anywhere; any other op makes it None.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from kosmos.passes.moe import op_name

_VIEWS = ("view_as", "view", "contiguous")
_NEUTRAL = ("_set_grad_enabled",)


def _body(node: fx.Node, index: int) -> Optional[fx.Graph]:
    body = node.args[index] if len(node.args) > index else None
    gm = node.graph.owning_module
    if not isinstance(body, fx.Node) or body.op != "get_attr" or gm is None:
        return None
    sub = getattr(gm, body.target, None)
    return sub.graph if isinstance(sub, fx.GraphModule) else None


def _first_output(graph: fx.Graph) -> Optional[fx.Node]:
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    while isinstance(out, (tuple, list)):
        if not out:
            return None
        out = out[0]
    return out if isinstance(out, fx.Node) else None


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


def _body_kind(graph: fx.Graph) -> Optional[tuple[str, Optional[str]]]:
    """("identity", None) or ("all_reduce", group_name) for a one-input body, else None."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    out = _first_output(graph)
    if len(inputs) != 1 or out is None:
        return None
    calls = [n for n in graph.nodes if n.op in ("call_function", "call_method") and op_name(n) not in _NEUTRAL]
    reduces = [n for n in calls if op_name(n) == "all_reduce"]
    if not reduces:
        if all(op_name(n) in _VIEWS for n in calls) and _strip_views(out) is inputs[0]:
            return "identity", None
        return None
    if len(reduces) != 1:
        return None
    (ar,) = reduces
    buf = ar.args[0]
    if len(ar.args) < 3 or ar.args[1] != "sum" or _strip_views(buf) is not inputs[0]:
        return None
    waits = [u for u in ar.users if op_name(u) == "wait_tensor"]
    copies = [u for w in waits for u in w.users if op_name(u) == "copy_" and u.args[0] is buf]
    if len(waits) != 1 or len(copies) != 1 or not _is_view_of(out, buf):
        return None
    allowed = set([ar] + waits + copies)
    if any(n not in allowed and op_name(n) not in _VIEWS for n in calls):
        return None
    return "all_reduce", ar.args[2]


def autograd_fn_kind(node: fx.Node) -> Optional[tuple[str, str, Optional[str]]]:
    """(forward kind, backward kind, group name) of an `autograd_function_apply` node with one tensor input, where
    each kind is "identity" or "all_reduce"; None for anything else (other ops, two collectives' groups)."""
    if op_name(node) != "autograd_function_apply" or len(node.args) != 3:
        return None
    bodies = [_body(node, 0), _body(node, 1)]
    if any(b is None for b in bodies):
        return None
    kinds = [_body_kind(b) for b in bodies]
    if any(k is None for k in kinds):
        return None
    groups = {k[1] for k in kinds if k[1] is not None}
    if len(groups) > 1:
        return None
    return kinds[0][0], kinds[1][0], next(iter(groups), None)
