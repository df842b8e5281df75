"""Pre-grad finder for expert-parallel MoE blocks that carry their own collectives and that no rewrite took.

It runs after the rewriting passes (kosmos.passes.moe takes transformers' AllReduceEP), so what it reports is
what stays unfused, with the reason: mostly all-to-all forms that a graph break split in two.

Recognises, in a Dynamo graph, grouped-GEMM experts that are wired to communication:
- all-to-all EP (torchtitan ExpertParallel, transformers AllToAllEP): tokens dispatched with an
  `all_to_all_single` (float payload), often after an `all_to_all_single` of integer token counts, the local experts'
  grouped GEMMs, and the results combined with a second `all_to_all_single`;
- all-reduce EP (transformers AllReduceEP / the older ep_router + moe_tp_experts plan): non-local routes masked,
  local grouped GEMMs on the whole batch, and an `all_reduce` of the output (often inside an autograd.Function, i.e.
  in the `fwd_body` subgraph of a `higher_order.autograd_function_apply` node).
Anchor: the grouped GEMM nodes (`torch._grouped_mm`, `transformers::grouped_mm_fallback`) grouped by their shared
offsets tensor. From them it walks back from the token operand (dispatch side) and forward from the outputs
(combine side), through data movement and elementwise ops, stopping at other matmuls, placeholders and the first
collective on each path (in-place writes such as `buf[perm] = out` are followed to the written buffer).

Each candidate is recorded as a `PassRecord(kind="moe_layer_ep", rewritten=False)` whose reason names the form and the
collectives seen. All-to-all EP with host-read split sizes (`.tolist()`) does not trace into one graph by default: the
graph breaks on `aten._local_scalar_dense` (`capture_scalar_outputs=False`), so this finder sees the halves in separate
graphs; for a half it adds where the graph resumed (Dynamo's `torch_dynamo_resume_in_<fn>_at_<line>` frames in the
nodes' stack traces) and the data-dependent break reasons Dynamo has counted so far in this process.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import torch
import torch.fx as fx

from kosmos.passes.moe import op_name
from kosmos.reporting import PassRecord, dynamo_graph_breaks, record

KIND = "moe_layer_ep"
_GRAPH = "pre-grad"
_GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")
# nodes a dispatch / combine walk does not cross: other GEMMs (the router linear, the next layer)
_STOP = ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "einsum")
_COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
                "reduce_scatter", "all_to_all")
_SUFFIX = ("; the MoE pass rewrites such a block only where it traces whole into one graph "
           "(README: expert-parallel forms)")
_MAX_WALK = 400  # nodes one walk may visit


def _namespace(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return str(t).split("::")[0].split(".")[0]
    return getattr(t, "__module__", "") or ""


def _val(node: Any):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) in _COLLECTIVES and (
        "c10d" in _namespace(node) or "distributed" in _namespace(node))


def _is_float(node: fx.Node) -> bool:
    v = _val(node.args[0] if node.args else None)
    if not isinstance(v, torch.Tensor):
        v = _val(node)
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _hop_collectives(gm: fx.GraphModule, node: fx.Node) -> tuple[list[str], list[str]]:
    """Collectives inside an autograd.Function traced as `autograd_function_apply(fwd_body, bwd_body, ...)`:
    (forward ones, backward ones)."""
    if op_name(node) != "autograd_function_apply":
        return [], []
    out = []
    for body in node.args[:2]:
        names = []
        if isinstance(body, fx.Node) and body.op == "get_attr":
            try:
                sub = gm.get_submodule(body.target)
            except AttributeError:
                sub = None
            if isinstance(sub, fx.GraphModule):
                names = [op_name(n) for n in sub.graph.nodes if _is_collective(n)]
        out.append(names)
    return out[0], out[1]


def _mutated(node: fx.Node) -> Optional[fx.Node]:
    """The tensor an in-place node writes (`buf[i] = v`, `buf.index_put_(...)`, `buf.copy_(v)`), if any."""
    op = op_name(node) or ""
    if op in ("setitem",) or (op.endswith("_") and not op.startswith("_")):
        target = node.args[0] if node.args else None
        return target if isinstance(target, fx.Node) else None
    return None


@dataclasses.dataclass
class Collective:
    op: str  # all_to_all_single, all_reduce, ...
    role: str  # "dispatch", "counts", "combine", "backward"
    node: fx.Node
    in_autograd_function: bool = False

    def text(self) -> str:
        where = " in an autograd.Function" if self.in_autograd_function else ""
        return {"dispatch": f"dispatch {self.op}", "counts": f"token-count {self.op}",
                "combine": f"combine {self.op}{where}", "backward": f"backward-only {self.op}{where}"}[self.role]


@dataclasses.dataclass
class EpMoeCandidate:
    """Grouped-GEMM experts of one block (one offsets tensor) and the collectives wired to them."""

    gemms: list[fx.Node]
    collectives: list[Collective]
    tokens_from_input: bool  # the token operand reaches a graph input with no collective on the way
    resumed_after: Optional[str]  # "file:line in fn" where this graph resumed after a graph break, if it did
    shapes: dict

    def roles(self, role: str) -> list[Collective]:
        return [c for c in self.collectives if c.role == role]

    @property
    def form(self) -> str:
        dispatch, combine = self.roles("dispatch"), self.roles("combine")
        combine_ops = {c.op for c in combine}
        if "all_reduce" in combine_ops and not dispatch:
            return "all-reduce EP (masked local experts -> grouped GEMM -> all_reduce of the output)"
        if dispatch and combine:
            return "all-to-all EP (dispatch -> grouped GEMM of local experts -> combine)"
        if combine:
            return "all-to-all EP, combine half (grouped GEMM -> combine; the dispatch is in an earlier graph)"
        return "all-to-all EP, dispatch half (dispatch -> grouped GEMM; the combine is in a later graph)"

    @property
    def is_half(self) -> bool:
        """Only one side of an all-to-all block is in this graph (a graph break split it)."""
        dispatch, combine = self.roles("dispatch"), self.roles("combine")
        return bool(dispatch) != bool(combine) and "all_reduce" not in {c.op for c in combine}

    def reason(self) -> str:
        seen = ", ".join(c.text() for c in self.collectives)
        text = f"candidate not yet fused: {self.form} ({seen}){_SUFFIX}"
        if self.is_half:
            text += "; " + break_note(self.resumed_after)
        return text

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.gemms) + tuple(c.node.name for c in self.collectives)

    def record(self) -> None:
        record(PassRecord(kind=KIND, graph=_GRAPH, rewritten=False, reason=self.reason(), nodes=self.nodes,
                          shapes=self.shapes))


_RESUME = re.compile(r'File "([^"]+)", line \d+, in torch_dynamo_resume_in_(\w+?)_at_(\d+)')


def _resumed_after(graph: fx.Graph) -> Optional[str]:
    for n in graph.nodes:
        m = _RESUME.search(n.meta.get("stack_trace") or "")
        if m:
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(3)} in {m.group(2)}"
    return None


def graph_break_reasons() -> list[str]:
    """First lines of the data-dependent graph-break reasons Dynamo has counted in this process (all frames)."""
    reasons = []
    for msg in dynamo_graph_breaks():
        first = str(msg).strip().splitlines()[0]
        detail = re.search(r"Operator `([^`]+)`", str(msg))
        if re.search(r"data.dependent|dynamic shape", str(msg), re.I):
            reasons.append(first + (f" ({detail.group(1)})" if detail else ""))
    return sorted(set(reasons))


def break_note(resumed_after: Optional[str]) -> str:
    where = f"this graph resumes after a graph break at {resumed_after}" if resumed_after else \
        "the block spans several graphs"
    reasons = graph_break_reasons()
    why = f"; data-dependent breaks seen: {'; '.join(reasons)}" if reasons else ""
    return (f"{where}{why}; split sizes read on the host (.tolist()) break the graph unless "
            "torch._dynamo.config.capture_scalar_outputs = True")


def _offsets(node: fx.Node) -> Any:
    if len(node.args) > 2:
        return node.args[2]
    return node.kwargs.get("offs")


def _walk(gm: fx.GraphModule, starts: list[fx.Node], forward: bool, gemms: set[fx.Node]):
    """Collectives reached from `starts` (forward: users; backward: inputs), plus whether a graph input was reached."""
    found: dict[fx.Node, bool] = {}  # collective or autograd_function_apply node -> reached
    hit_input = False
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack and len(seen) < _MAX_WALK:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in starts:
            if _is_collective(n) or op_name(n) == "autograd_function_apply":
                found[n] = True
                if not (op_name(n) == "autograd_function_apply" and not any(_hop_collectives(gm, n))):
                    continue  # the first collective on a path ends it
            elif n in gemms or op_name(n) in _GROUPED_MM or op_name(n) in _STOP:
                continue
            elif n.op == "placeholder":
                hit_input = True
                continue
        if forward:
            nxt = list(n.users)
            target = _mutated(n)
            if target is not None:
                nxt.append(target)  # data written into another buffer flows on through that buffer's users
        else:
            nxt = list(n.all_input_nodes)
            if n in starts:
                nxt = [a for a in [n.args[0]] if isinstance(a, fx.Node)]  # only the token operand of a GEMM
            # a buffer filled in place (`buf[perm] = x`) carries the data of its writers
            nxt += [u.args[2] for u in n.users
                    if op_name(u) == "setitem" and u.args[0] is n and isinstance(u.args[2], fx.Node)]
        stack.extend(x for x in nxt if isinstance(x, fx.Node))
    return list(found), hit_input


def find_ep_moe_candidates(gm: fx.GraphModule) -> list[EpMoeCandidate]:
    """Grouped-GEMM expert blocks of `gm` that have a dispatch or combine collective; blocks without one are not
    reported here (kosmos.passes.moe handles those)."""
    groups: dict[Any, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and op_name(n) in _GROUPED_MM and not n.meta.get("kosmos_moe_reported"):
            key = _offsets(n)
            groups.setdefault(key if isinstance(key, fx.Node) else n, []).append(n)
    resumed = _resumed_after(gm.graph)
    out = []
    for gemms in groups.values():
        gset = set(gemms)
        back, from_input = _walk(gm, gemms, forward=False, gemms=gset)
        fwd, _ = _walk(gm, gemms, forward=True, gemms=gset)
        collectives: list[Collective] = []
        for node, role_side in [(n, "back") for n in back] + [(n, "fwd") for n in fwd]:
            if op_name(node) == "autograd_function_apply":
                fwd_ops, bwd_ops = _hop_collectives(gm, node)
                for op in fwd_ops:
                    collectives.append(Collective(op, "combine" if role_side == "fwd" else "dispatch", node, True))
                for op in bwd_ops:
                    if not fwd_ops:
                        collectives.append(Collective(op, "backward", node, True))
                continue
            if role_side == "fwd":
                role = "combine"
            else:
                role = "dispatch" if _is_float(node) else "counts"
            collectives.append(Collective(op_name(node), role, node))
        if not any(c.role in ("dispatch", "combine") for c in collectives):
            continue
        collectives.sort(key=lambda c: ("counts", "dispatch", "backward", "combine").index(c.role))
        v = _val(gemms[0].args[0])
        w = _val(gemms[0].args[1])
        shapes = {}
        if isinstance(v, torch.Tensor):
            shapes["tokens"] = tuple(v.shape)
        if isinstance(w, torch.Tensor):
            shapes["local_experts"] = w.shape[0]
        shapes["gemms"] = len(gemms)
        out.append(EpMoeCandidate(gemms, collectives, from_input, resumed, shapes))
    return out


def run(gm: fx.GraphModule, example_inputs, options) -> int:
    """Records every collective-carrying MoE candidate of `gm` (nothing is rewritten); returns how many."""
    cands = find_ep_moe_candidates(gm)
    for c in cands:
        c.record()
    return len(cands)
