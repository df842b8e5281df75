"""Pre-grad: the model's F.embedding calls -> kosmos::embedding, so the embedding's backward runs aten's kernel and
not Inductor's decomposition with its fp32 [num_weights, H] buffer (kosmos/ops/embedding.py says why). Each call is
reported, rewritten or left alone with the reason (kind "embedding")."""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from kosmos.reporting import PassRecord, record

KIND = "embedding"
_SIGNATURE = inspect.signature(F.embedding)


def _value(arg):
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else None


def _bound(node: fx.Node) -> dict:
    bound = _SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return bound.arguments


def _left_alone_reason(a: dict) -> Optional[str]:
    """Why this F.embedding call keeps Inductor's lowering, or None to rewrite it."""
    weight, indices = _value(a["weight"]), _value(a["input"])
    if not isinstance(weight, torch.Tensor) or not isinstance(indices, torch.Tensor):
        return "weight or indices not a traced tensor"
    if type(weight) is not torch._subclasses.FakeTensor:
        return f"weight is a {type(weight).__name__} (tensor subclass): left to its own dispatch"
    if not weight.requires_grad or not torch.is_grad_enabled():
        return "weight needs no gradient (frozen, or grad mode off): no backward to change"
    if a["max_norm"] is not None:
        return "max_norm renormalizes the weight in place"
    if a["sparse"]:
        return "sparse gradient"
    if weight.dim() != 2 or indices.dtype not in (torch.int32, torch.int64):
        return f"weight {tuple(weight.shape)} / indices {indices.dtype}: not a 2-D table with integer indices"
    if not isinstance(a["padding_idx"], (int, type(None))) or not isinstance(a["scale_grad_by_freq"], bool):
        return "padding_idx / scale_grad_by_freq not constants"
    return None


def run(gm: fx.GraphModule, graph_kind: str = "pre-grad") -> int:
    """Rewrites gm's F.embedding calls that train their weight; returns how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=F.embedding)):
        a = _bound(node)
        reason = _left_alone_reason(a)
        weight = _value(a["weight"])
        shapes = {"num_weights": weight.shape[0], "dim": weight.shape[-1]} if isinstance(weight, torch.Tensor) else {}
        if reason is not None:
            record(PassRecord(KIND, graph_kind, False, reason, (node.name,), shapes))
            continue
        padding_idx = a["padding_idx"]  # F.embedding's normalization: None -> -1 (none), negative -> from the end
        padding_idx = -1 if padding_idx is None else padding_idx + weight.shape[0] if padding_idx < 0 else padding_idx
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.kosmos.embedding.default,
                                          (a["weight"], a["input"], padding_idx, a["scale_grad_by_freq"]))
        call.meta.update(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        record(PassRecord(KIND, graph_kind, True, "backward by aten's kernel, not Inductor's decomposition (no "
                          f"{weight.shape[0]} x {weight.shape[-1]} fp32 buffer)", (call.name,), shapes))
        done += 1
    if done:
        gm.recompile()
    return done
