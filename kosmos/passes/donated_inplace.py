"""Backward graphs: lets a kosmos op that overwrites a saved tensor (moe_layer_backward's saved_up) write the saved
buffer itself instead of a copy of it.

AOT autograd functionalizes the mutation (auto_functionalized_v2 over the saved tensor, a backward placeholder).
Inductor's reinplacing keeps a clone for any placeholder without a copy_ back into it; its scheduler then reuses
the donated placeholder's buffer for that clone, which leaves a kernel copying the buffer onto itself (0.8 GB read
and written per Qwen3-235B layer at T = 16384, 0.38 ms of the H200's backward). A donated saved tensor
(TracingContext fw_metadata.bw_donated_idxs: not aliased by any forward input or output; AOT autograd raises if a
second backward runs through its graph) that nothing else in the graph reads may be overwritten in place, which is
what this pass writes: the op called directly on the placeholder. Each candidate is reported (kind
"saved_up_in_place"), with the reason where Inductor's copy stays (retain_graph, donated_buffer off, other readers)."""
from __future__ import annotations

import operator
from typing import Optional

import torch

from kosmos.reporting import PassRecord, record

KIND = "saved_up_in_place"


def _inplace_ops() -> tuple:
    return (torch.ops.kosmos.moe_layer_backward.default,)


def _donated_placeholders(graph: torch.fx.Graph) -> set:
    from torch._inductor import utils

    get = getattr(utils, "get_donated_idxs", None)  # torch >= 2.6
    idxs = get() if get is not None else None
    placeholders = list(graph.find_nodes(op="placeholder"))
    return {placeholders[i] for i in (idxs or ()) if i < len(placeholders)}


def _direct_kwargs(hop_kwargs: dict, op) -> Optional[dict]:
    """The op's own kwargs from auto_functionalized_v2's, each mutable argument bound to its base; None unless every
    mutable argument is its base itself (no view of it) or None."""
    from torch._higher_order_ops.auto_functionalize import get_mutable_args

    kwargs = dict(hop_kwargs)
    bases = kwargs.pop("_all_bases")
    mutable, _ = get_mutable_args(op)
    for name in mutable:
        index = kwargs.pop(f"_{name}_base_index", "missing")
        if index == "missing" or any(k.startswith(f"_{name}_") for k in kwargs):
            return None  # a list argument or a view of a base: left to Inductor
        kwargs[name] = None if index is None else bases[index]
    return kwargs


def _schema_args(op, kwargs: dict) -> tuple[tuple, dict]:
    """(positional args, keyword-only args) in the op's schema order (Inductor's lowering normalises positions)."""
    args, kw, defaults = [], {}, []
    for a in op._schema.arguments:
        value = kwargs[a.name] if a.name in kwargs else a.default_value
        if a.kwarg_only:
            kw[a.name] = value
        else:
            args.append(value)
            defaults.append(a.has_default_value() and (value is a.default_value or (
                isinstance(value, (bool, int, float, str)) and value == a.default_value)))
    while defaults and defaults[-1]:  # trailing defaults stay implicit, as Inductor's own decomposition leaves them
        defaults.pop()
        args.pop()
    return tuple(args), kw


def run(graph: torch.fx.Graph) -> int:
    """Rewrites each eligible auto_functionalized_v2 of a kosmos in-place op; returns how many."""
    hop = torch.ops.higher_order.auto_functionalized_v2
    nodes = [n for n in graph.find_nodes(op="call_function", target=hop) if n.args[0] in _inplace_ops()]
    if not nodes:
        return 0
    donated = _donated_placeholders(graph)
    done = 0
    for node in nodes:
        op, bases = node.args[0], node.kwargs["_all_bases"]
        why = None
        if not bases:
            continue
        if all(b.op != "placeholder" for b in bases):  # recomputed here (activation checkpointing)
            record(PassRecord(KIND, "backward", False, f"{op._schema.name}'s buffer is made in this graph (a "
                              "recomputed forward): Inductor's reinplacing overwrites it when nothing reads it after",
                              (node.name,)))
            continue
        if any(b not in donated for b in bases):
            why = "a base is not a donated saved tensor"
        elif any(len(b.users) != 1 for b in bases):
            why = "a base has other readers"
        kwargs = None if why else _direct_kwargs(node.kwargs, op)
        if kwargs is None:
            record(PassRecord(KIND, "backward", False, f"{op._schema.name} overwrites a copy of its saved buffer "
                              f"(Inductor's): {why or 'a view or list argument'}", (node.name,)))
            continue
        n_out = len(op._schema.returns)
        with graph.inserting_before(node):
            call = graph.call_function(op, *_schema_args(op, kwargs))
        call.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
        call.meta["val"] = node.meta["val"][:n_out]
        eager = node.meta.get("eager_input_vals")  # the HOP's (args, kwargs): Inductor keeps the op's eager strides
        eager_kwargs = _direct_kwargs(eager[1], op) if eager is not None else None
        if eager_kwargs is not None:
            call.meta["eager_input_vals"] = _schema_args(op, eager_kwargs)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise AssertionError(f"kosmos donated_inplace: unexpected user {user.format_node()}")
            i = user.args[1]
            if i < n_out:
                user.args = (call, i)
            else:  # the new value of a base: the base itself, overwritten in place
                user.replace_all_uses_with(bases[i - n_out])
                graph.erase_node(user)
        graph.erase_node(node)
        record(PassRecord(KIND, "backward", True, f"{op._schema.name} overwrites its donated saved buffer itself "
                          "(no copy)", (call.name,)))
        done += 1
    return done
