"""Small FX editing helpers shared by the rewrites: insertion order, fake-tensor meta, size arguments, cleanup."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import map_arg


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def depends_on(node: fx.Node, ancestors: set[fx.Node], stop_before: int, pos: dict[fx.Node, int]) -> bool:
    """True if `node` (transitively) reads any of `ancestors`; nodes before `stop_before` cannot."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in ancestors:
            return True
        if n in seen or pos[n] < stop_before:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def hoist_before(node: fx.Node, anchor: fx.Node, pos: dict[fx.Node, int]) -> None:
    """Moves `node` and the inputs it needs to just before `anchor` if they come after it.

    Only for nodes that do not depend on anything at or after `anchor`'s rewrite (callers check that
    the moved nodes do not read the tensors being replaced)."""
    if pos[node] < pos[anchor]:
        return
    for inp in node.all_input_nodes:
        hoist_before(inp, anchor, pos)
    anchor.prepend(node)
    pos[node] = pos[anchor] - 0.5


def _size_val(node: fx.Node):
    v = node.meta.get("val")
    return v if isinstance(v, torch.SymInt) else None


def _movable_size_node(node: fx.Node, before: fx.Node, pos: dict[fx.Node, int]) -> bool:
    """True if `node` precedes `before`, or is SymInt arithmetic on such nodes (so it can be hoisted)."""
    if pos[node] < pos[before]:
        return True
    if node.op != "call_function" or _size_val(node) is None:
        return False
    return all(_movable_size_node(i, before, pos) for i in node.all_input_nodes)


def size_args(shape, before: fx.Node, pos: dict[fx.Node, int], hoist: bool = False,
              replaced: Iterable[fx.Node] = ()) -> Optional[list]:
    """Size arguments for a reshape to `shape` inserted before `before`, taken from the graph.

    Static sizes stay ints; each symbolic size becomes a node already in the graph whose value is
    that same expression (a placeholder, or SymInt arithmetic Inductor kept, hoisted above `before`
    when `hoist`); a single size no node gives becomes -1. Never a hint: the rewrite must not
    specialize a symbol. None when more than one size has no node. Sizes that depend on `replaced` (the
    nodes the rewrite replaces by what it builds from these sizes) are not taken: replacing would make a cycle."""
    from kosmos.passes.layout_probe import size_expr

    wanted = [size_expr(s) for s in shape]
    if all(isinstance(s, int) for s in wanted):
        return wanted
    replaced = set(replaced)
    first_replaced = min((pos[r] for r in replaced), default=float("inf"))
    by_expr: dict = {}
    for n in before.graph.nodes:
        v = _size_val(n)
        if v is not None and n.op in ("placeholder", "call_function"):
            e = size_expr(v)
            if not isinstance(e, int) and e not in by_expr and _movable_size_node(n, before, pos) \
                    and not depends_on(n, replaced, first_replaced, pos):
                by_expr[e] = n
    out, unresolved = [], 0
    for e in wanted:
        if isinstance(e, int):
            out.append(e)
        elif e in by_expr:
            out.append(by_expr[e])
        else:
            unresolved += 1
            out.append(-1)
    if unresolved > 1:
        return None
    if hoist:
        for a in out:
            if isinstance(a, fx.Node):
                hoist_before(a, before, pos)
    return out


def set_fake_val(node: fx.Node, like: Iterable[fx.Node]) -> None:
    """Computes node.meta['val'] by running its target on the fake values of its inputs."""
    vals = [n.meta.get("val") for n in like]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    args = map_arg(node.args, lambda n: n.meta["val"])
    kwargs = map_arg(node.kwargs, lambda n: n.meta["val"])
    if mode is None:
        return
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def call(graph: fx.Graph, target, args, kwargs=None, like=()) -> fx.Node:
    node = graph.call_function(target, tuple(args), kwargs or {})
    set_fake_val(node, like or node.all_input_nodes)
    return node


def erase_unused(nodes: Iterable[fx.Node]) -> None:
    """Erases the given nodes that have no users, repeatedly (a node freed by an erase is erased too)."""
    pending = set(nodes)
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users:
                inputs = n.all_input_nodes
                n.graph.erase_node(n)
                pending.discard(n)
                pending.update(i for i in inputs if i.op == "call_function" and _is_pure_helper(i))
                changed = True


def _is_pure_helper(node: fx.Node) -> bool:
    """Nodes that may be dropped once unused: anything that is not a collective or a mutation."""
    target = getattr(node.target, "_schema", None)
    if target is not None and target.is_mutable:
        return False
    ns = getattr(node.target, "namespace", "")
    return ns not in ("_c10d_functional", "c10d_functional", "_dtensor")
