"""Pre-grad MoE pass: finds HF transformers v5 MoE blocks in the Dynamo graph and replaces each by one
`kosmos::moe_layer` call (see kosmos/ops/moe.py for the op's semantics).

The block it matches is a softmax router (linear [-> .float()] -> softmax -> top-k [-> renorm] [-> scale] [->
cast]: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral in fp32, DeepSeek-V2's greedy top-k) or DeepSeek-V3's (fp32 linear ->
sigmoid [+ e_score_correction_bias] -> group-limited top-k -> gather [-> renorm] -> scale; GLM-4.5, dots.llm1)
followed by HF's `grouped_mm` experts implementation (the default): sort -> histc -> cumsum offsets ->
grouped GEMM gate_up -> SiLU * up -> grouped GEMM down -> weighting -> inverse permutation -> fold. The grouped
GEMM is `torch._grouped_mm` (CUDA, CPU bf16) or `transformers::grouped_mm_fallback` (other dtypes); transformers
5.17 adds EP-sentinel nodes (`ge`, `clamp_`, `masked_fill_`, `masked_fill`) that are no-ops without EP.

Matching is anchored on the grouped GEMM pairs (two GEMMs sharing one offsets tensor), walks the experts and the
router node by node (each step checks the op and its constants; shapes and dtypes come from the fake values
Dynamo attached), then checks the block is closed: it reads nothing but the hidden states, the router weight
(and buffers) and the two expert weights, and nothing outside uses its intermediates except the router logits
(rewired to the op's logits output, e.g. for the aux loss). Candidates that fail a check are left alone and
recorded with the reason. Shared experts stay ordinary code.

Expert parallelism: `kosmos.parallelize(..., expert_parallel=True)` makes the experts module call
`kosmos::moe_experts(hidden, ids, weights, gate_up, down, "silu", ep_group_name, ep_world_size)` on its local
experts. That call is a second anchor: the same router matchers run on its topk ids / weights, and the block becomes
one moe_layer that carries the call's ep_group_name / ep_world_size (the EP split travels in the graph as the op's
arguments, so the pass needs no map from graph inputs back to modules). moe_experts calls without EP (HF's
experts_implementation="kosmos") are left as they are.
"""
from __future__ import annotations

import dataclasses
import functools
import keyword
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from kosmos.reporting import PassRecord, record

KIND = "moe_layer"
_GRAPH = "pre-grad"
_GROUPED_MM = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")
_CASTS = ("to", "type", "float", "bfloat16", "half", "double", "_to_copy")
_VIEWS = ("view", "reshape", "flatten", "contiguous")
_DIVS = ("itruediv", "truediv", "div", "div_")
_TRANSPOSES = {(-2, -1), (-1, -2), (1, 2), (2, 1)}
_EXPERTS_HINT = "set experts_implementation='kosmos' (kosmos.hf_experts) to route the experts through kosmos"


class _NoMatch(Exception):
    """A candidate does not have the expected form; the message says where and why."""


# ------------------------------------------------------------------------------------------ helpers


def op_name(node: Any) -> Optional[str]:
    """A short op name for call_function / call_method nodes, the same for `torch.topk(x)` and `x.topk()`."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _operator_name(node.target)
    if node.op != "call_function":
        return None
    t = node.target
    if isinstance(t, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return (t._qualified_op_name.split("::")[-1] if hasattr(t, "_qualified_op_name")
                else t.name().split("::")[-1].split(".")[0])
    return getattr(t, "__name__", str(t))


def _operator_name(method: str) -> str:
    """`x.__eq__(y)` -> "eq", the name of `operator.eq`: torch 2.11's Dynamo records some operators on tensors as
    dunder method calls where later versions record the `operator` function."""
    if not (method.startswith("__") and method.endswith("__") and len(method) > 4):
        return method
    name = method[2:-2]
    return name + "_" if keyword.iskeyword(name) else name  # __and__ -> and_, like operator.and_


def _val(node: Any):
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _shape(node: Any) -> Optional[tuple]:
    v = _val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(node: Any):
    v = _val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _describe(node: Any) -> str:
    if isinstance(node, fx.Node):
        return f"{node.name} ({node.op} {op_name(node) or node.target})"
    return repr(node)


_REQUIRED = object()


def _arg(node: fx.Node, index: int, name: str, default: Any = _REQUIRED) -> Any:
    if len(node.args) > index:
        return node.args[index]
    if name in node.kwargs:
        return node.kwargs[name]
    if default is _REQUIRED:
        raise _NoMatch(f"{node.name}: no argument {name!r}")
    return default


def _root(node: fx.Node) -> fx.Node:
    """Strips view/reshape chains: the tensor whose elements `node` shows."""
    while op_name(node) in _VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


class _Walk:
    """Visits the nodes of one candidate, checking each; remembers every node it accepted."""

    def __init__(self):
        self.nodes: dict[fx.Node, None] = {}

    def call(self, node: Any, ops: tuple[str, ...], what: str) -> fx.Node:
        if op_name(node) not in ops:
            raise _NoMatch(f"{what}: expected {'/'.join(ops)}, found {_describe(node)}")
        self.nodes[node] = None
        return node

    def getitem(self, node: Any, index: int, what: str) -> fx.Node:
        """`node` must be `source[index]` of a multi-output op; returns source."""
        self.call(node, ("getitem",), what)
        if node.args[1] != index or not isinstance(node.args[0], fx.Node):
            raise _NoMatch(f"{what}: expected output {index} of a multi-output op, found {_describe(node)}")
        return node.args[0]

    def strip(self, node: Any, ops: tuple[str, ...]) -> Any:
        """Accepts an optional op in front of `node` and returns its input."""
        while op_name(node) in ops:
            self.nodes[node] = None
            node = node.args[0]
        return node

    def user(self, node: fx.Node, ops: tuple[str, ...], what: str, exclude=()) -> fx.Node:
        users = [u for u in node.users if u not in exclude]
        if len(users) != 1:
            raise _NoMatch(f"{what}: {node.name} should have one user, has {[u.name for u in users]}")
        return self.call(users[0], ops, what)


def _const(value: Any, expected: Any, what: str) -> None:
    if value != expected:
        raise _NoMatch(f"{what}: expected {expected!r}, found {value!r}")


def _dim_last(node: fx.Node, index: int, ndim: int, what: str, name: str = "dim") -> None:
    dim = _arg(node, index, name, -1)
    if dim not in (-1, ndim - 1):
        raise _NoMatch(f"{what}: expected the last dim, found dim={dim!r}")


# ------------------------------------------------------------------------------------------ matches


@dataclasses.dataclass
class RouterConfig:
    top_k: int
    scoring: str
    norm_topk_prob: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_dtype: Optional[torch.dtype] = None
    weights_dtype: Optional[torch.dtype] = None  # the routing weights' dtype when it is not the logits' (Mixtral)

    def text(self) -> str:
        s = f"{self.scoring} top-{self.top_k}"
        if self.n_group > 1:
            s += f" of {self.topk_group}/{self.n_group} groups"
        if self.norm_topk_prob:
            s += ", renormalised"
        if self.routed_scaling_factor != 1.0:
            s += f", x{self.routed_scaling_factor:g}"
        if self.weights_dtype is not None:
            s += f", weights in {str(self.weights_dtype).replace('torch.', '')}"
        return s


@dataclasses.dataclass
class MoeLayerMatch:
    """One HF MoE block: router + grouped_mm experts + fold, with its inputs and its one output."""

    hidden: fx.Node  # [T, H] tokens, as the router reads them (before any router cast)
    router_weight: fx.Node  # [E, H]
    router_bias: Optional[fx.Node]
    score_correction_bias: Optional[fx.Node]  # [E], selection only
    gate_up: fx.Node  # [E, 2I, H] if not gate_up_transposed, else [E, H, 2I] (the grouped GEMM's own operand)
    gate_up_transposed: bool
    down: fx.Node  # [E, H, I] (or [E, I, H] if down_transposed)
    down_transposed: bool
    router: RouterConfig
    output: fx.Node  # the folded [T, H] output
    logits: fx.Node  # the router logits [T, E]
    nodes: list[fx.Node]  # every node the op replaces (erased after the rewrite)
    shapes: dict
    with_logits: bool = False  # the graph uses the router logits outside the block (set by find_moe_layers)
    experts_hidden: Optional[fx.Node] = None  # the view of the tokens the experts gathered from, if another one
    ep: tuple = (None, 1)  # (ep_group_name, ep_world_size) of an expert-parallel block
    ep_mode: str = "all_to_all"  # "all_reduce": transformers' AllReduceEP (replicated tokens, outputs summed)
    ep_note: str = ""  # what the rewrite assumes about an EP form, said in the report

    def inputs(self) -> list[fx.Node]:
        return [n for n in (self.hidden, self.router_weight, self.router_bias, self.score_correction_bias,
                            self.gate_up, self.down) if n is not None]

    def replace(self, graph: fx.Graph) -> fx.Node:
        """Inserts the kosmos::moe_layer call after the last of its inputs and rewires the output (and logits)."""
        region = set(self.nodes)
        with graph.inserting_before(insertion_point(graph, self.inputs(), self.logits, region)):
            gate_up, down = self.gate_up, self.down
            if self.gate_up_transposed:
                gate_up = _new(graph, "call_method", "transpose", (gate_up, -2, -1), like=self.output)
            if self.down_transposed:
                down = _new(graph, "call_method", "transpose", (down, -2, -1), like=self.output)
            r = self.router
            args = (self.hidden, self.router_weight, self.router_bias, self.score_correction_bias, gate_up, down,
                    r.top_k, r.scoring, r.norm_topk_prob, r.n_group, r.topk_group, r.routed_scaling_factor,
                    r.router_dtype, "silu", self.with_logits, self.ep[0], self.ep[1])
            if self.ep_mode != "all_to_all" or r.weights_dtype is not None:
                args += (self.ep_mode,)
            if r.weights_dtype is not None:
                args += (True, r.weights_dtype)  # save_up, weights_dtype
            return emit_moe_layer(graph, args, self.output, self.logits, self.with_logits, region)

    def erase(self, graph: fx.Graph) -> None:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(self.nodes, key=pos.__getitem__, reverse=True):
            graph.erase_node(node)
        for node in self.inputs() + [self.experts_hidden]:  # views of the tokens that only the block read
            while op_name(node) in _VIEWS and not node.users:
                source = node.args[0]
                graph.erase_node(node)
                node = source

    def record(self, impl: str, impl_reason: str) -> None:
        record(PassRecord(
            kind=KIND, graph=_GRAPH, rewritten=True,
            reason=f"router ({self.router.text()}) + grouped_mm SwiGLU experts + fold -> kosmos::moe_layer"
            + (" (returns router logits)" if self.with_logits else "")
            + (f" (expert parallel: group {self.ep[0]}, {self.ep[1]} ranks"
               + (", replicated tokens, outputs summed by all_reduce" if self.ep_mode == "all_reduce" else "")
               + (f"; {self.ep_note}" if self.ep_note else "") + ")"
               if self.ep[0] is not None else ""),
            nodes=tuple(n.name for n in self.nodes), shapes=self.shapes, impl=impl, impl_reason=impl_reason,
        ))


@dataclasses.dataclass
class LeftAlone:
    reason: str
    nodes: tuple[str, ...]
    shapes: dict = dataclasses.field(default_factory=dict)

    def record(self) -> None:
        record(PassRecord(kind=KIND, graph=_GRAPH, rewritten=False, reason=self.reason, nodes=self.nodes,
                          shapes=self.shapes))


def _new(graph: fx.Graph, op: str, target, args, like: fx.Node) -> fx.Node:
    node = graph.create_node(op, target, args)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    if op == "call_method":  # a transpose view of a weight
        v = _val(args[0])
        if isinstance(v, torch.Tensor):
            node.meta["example_value"] = v.transpose(-2, -1)
    return node


def insertion_point(graph: fx.Graph, inputs: list[fx.Node], logits: fx.Node, region: set) -> fx.Node:
    """Where a block's kosmos::moe_layer goes: right after the last of its inputs (before the returned node);
    refused if the router logits are read outside the block before that point."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max(inputs, key=pos.__getitem__)
    early = [u.name for u in logits.users if u not in region and pos[u] <= pos[anchor]]
    if early:
        raise _NoMatch(f"router logits are used by {early} before all the block's inputs exist")
    return anchor.next


def emit_moe_layer(graph: fx.Graph, args: tuple, output: fx.Node, logits: fx.Node, with_logits: bool,
                   region: set) -> fx.Node:
    """Inserts kosmos::moe_layer(*args) and its out (and logits) outputs at the insertion point, then rewires the
    block's output and the logits' users outside `region` to them; returns the call."""
    call = _new(graph, "call_function", torch.ops.kosmos.moe_layer.default, args, like=output)
    out = _new(graph, "call_function", operator.getitem, (call, 0), like=output)
    new_logits = _new(graph, "call_function", operator.getitem, (call, 1), like=logits) if with_logits else None
    _set_fake_values(call, [out, new_logits])
    output.replace_all_uses_with(out)
    if new_logits is not None:
        logits.replace_all_uses_with(new_logits, delete_user_cb=lambda u: u not in region)
    return call


def _set_fake_values(call: fx.Node, outs: list[Optional[fx.Node]]) -> None:
    """Runs the op's fake impl on the inputs' fake values, so later passes see shapes on the new nodes."""
    args = fx.node.map_arg(call.args, _val)
    modes = {id(a.fake_mode): a.fake_mode for a in args if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode")}
    if len(modes) != 1:
        return
    (mode,) = modes.values()
    with mode:
        vals = call.target(*args)
    call.meta["example_value"] = vals
    for i, node in enumerate(outs):
        if node is not None:
            node.meta["example_value"] = vals[i]


# ------------------------------------------------------------------------------------------ finders


@dataclasses.dataclass
class _Experts:
    hidden: fx.Node  # the [T, H] tensor the experts gather from
    topk_ids: fx.Node
    topk_weights: fx.Node
    gate_up: fx.Node
    gate_up_transposed: bool
    down: fx.Node
    down_transposed: bool
    output: fx.Node
    top_k: int
    num_experts: int
    ep: tuple = (None, 1)  # (ep_group_name, ep_world_size); the weights are then the local experts
    ep_mode: str = "all_to_all"
    ep_note: str = ""


TRANSFORMERS_5_17_EP_NOTE = (
    "transformers 5.17 form: its second sum of the routing weights' gradient is taken as equal to the first, which "
    "holds when the group's ranks hold the same tokens (the only case where this form computes the MoE layer)")


@dataclasses.dataclass
class _ReplicatedEp:
    """transformers' AllReduceEP around HF's grouped_mm experts (the rank is a constant of the traced graph):

        off_rank = (ids // E_loc) != rank;  local_ids = where(off_rank, E_loc, ids % E_loc)
        out = AllReduceForward(experts(AllReduceBackward(hidden), local_ids,
                                       AllReduceBackward(weights).masked_fill(off_rank, 0.0)))

    with the local experts' weights; E_loc is the sentinel id of pairs owned elsewhere."""

    rank: int
    off_rank: fx.Node
    group: Optional[str] = None
    note: str = ""

    def unwrap(self, walk: _Walk, node: Any, forward: str, backward: str, what: str) -> fx.Node:
        """node = autograd_function_apply(fwd_body, bwd_body, x)[0] whose directions are (forward, backward) -> x."""
        from kosmos.passes.autograd_fn import autograd_fn_kind, tensor_input

        v = _val(node)
        if forward == "identity" and op_name(node) != "getitem" and isinstance(v, torch.Tensor) and not v.requires_grad:
            return node  # Dynamo inlines the function when no input needs a gradient: its backward never runs
        apply = walk.getitem(node, 0, what)
        walk.call(apply, ("autograd_function_apply",), what)
        kind = autograd_fn_kind(apply)
        if kind is None or kind[:2] != (forward, backward):
            raise _NoMatch(f"{what}: {apply.name} is not an autograd.Function doing {forward} forward and {backward} "
                           f"backward (found {kind})")
        if self.group is not None and kind[2] is not None and kind[2] != self.group:
            raise _NoMatch(f"{what}: {apply.name} sums over group {kind[2]!r}, the block over {self.group!r}")
        self.group = self.group or kind[2]
        if len(apply.users) != 1:
            raise _NoMatch(f"{what}: {apply.name} has other users than {node.name}")
        walk.nodes.update(dict.fromkeys(apply.args[:2]))  # the get_attr nodes of its bodies
        return tensor_input(apply)


def _match_local_ids(walk: _Walk, ids: fx.Node, num_local: int) -> tuple[fx.Node, Optional[_ReplicatedEp]]:
    """AllReduceEP's id remapping to local ids with the sentinel E_loc -> (global ids, its EP form); else (ids, None).

    transformers >= 5.21: where(off_rank, E_loc, ids % E_loc); 5.17 (EpRouterParallel, E_loc > 1):
    m = fmod(ids.masked_fill(off_rank, -1), E_loc); m.masked_fill(m == -1, E_loc)."""
    if op_name(ids) == "where":
        where = walk.call(ids, ("where",), "EP local expert ids")
        off_rank, fill, mod = where.args
        _const(fill, num_local, "EP sentinel id")
        walk.call(mod, ("mod", "remainder"), "EP local expert id")
        _const(mod.args[1], num_local, "EP local expert modulus")
        global_ids = mod.args[0]
    elif op_name(ids) == "masked_fill" and op_name(ids.args[0]) == "fmod":
        sentinel = walk.call(ids, ("masked_fill",), "EP sentinel ids")
        _const(sentinel.args[2], num_local, "EP sentinel id")
        is_dropped = walk.call(sentinel.args[1], ("eq",), "EP dropped slots")
        fmod = walk.call(sentinel.args[0], ("fmod",), "EP local expert id")
        if is_dropped.args[0] is not fmod or is_dropped.args[1] != -1:
            raise _NoMatch(f"{is_dropped.name}: expected {fmod.name} == -1")
        if fmod.args[1] != num_local or num_local < 2:
            raise _NoMatch(f"{fmod.name}: expected fmod(ids, {num_local}) with at least 2 local experts")
        dropped = walk.call(fmod.args[0], ("masked_fill",), "EP dropped slots")
        _const(dropped.args[2], -1, "EP dropped slot id")
        global_ids, off_rank = dropped.args[0], dropped.args[1]
    else:
        return ids, None
    walk.call(off_rank, ("ne",), "EP off-rank mask")
    owner, rank = off_rank.args
    walk.call(owner, ("floordiv",), "EP expert owner")
    if owner.args[0] is not global_ids or owner.args[1] != num_local or not isinstance(rank, int):
        raise _NoMatch(f"{off_rank.name}: expected (ids // {num_local}) != rank on the global ids {global_ids.name}")
    return global_ids, _ReplicatedEp(rank, off_rank)


def _replicated_ep_group(rep: _ReplicatedEp, topk_ids: fx.Node, num_local: int) -> tuple[int, tuple]:
    """(number of experts, (group, world size)) of an AllReduceEP block, checked against the process group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    scores = (topk_ids.args[0].args[0] if op_name(topk_ids) == "getitem" and op_name(topk_ids.args[0]) == "topk"
              else None)
    num_experts = (_shape(scores) or (None,))[-1]
    if not isinstance(num_experts, int) or num_experts % num_local or rep.group is None:
        raise _NoMatch(f"expert-parallel ids {topk_ids.name}: cannot tell the experts ({num_experts}) or group")
    world = num_experts // num_local
    try:
        pg = _resolve_process_group(rep.group)
    except Exception as e:  # noqa: BLE001 - any lookup failure means the group is not usable here
        raise _NoMatch(f"expert-parallel group {rep.group!r} is not a process group here ({e})") from e
    if pg.size() != world or pg.rank() != rep.rank:
        raise _NoMatch(f"expert-parallel group {rep.group!r} is rank {pg.rank()} of {pg.size()}, the graph was traced "
                       f"for rank {rep.rank} of {world} ({num_experts} experts, {num_local} local)")
    return num_experts, (rep.group, world)


def _match_kosmos_experts(walk: _Walk, call: fx.Node) -> _Experts:
    """An expert-parallel `kosmos::moe_experts` call (kosmos.parallelize's EP experts): out = call[0]; its
    tokens_per_expert output must be unused."""
    walk.call(call, ("moe_experts",), "kosmos experts")
    hidden, topk_ids, topk_weights, gate_up, down = (_arg(call, i, n) for i, n in enumerate(
        ("hidden", "topk_ids", "topk_weights", "gate_up_proj", "down_proj")))
    _const(_arg(call, 5, "activation", "silu"), "silu", "experts activation")
    ep = (_arg(call, 6, "ep_group_name", None), _arg(call, 7, "ep_world_size", 1))
    outputs = {}
    for u in call.users:
        if op_name(u) != "getitem" or u.args[1] not in (0, 1) or (u.args[1] == 1 and u.users):
            raise _NoMatch(f"{call.name}: output used by {_describe(u)} (only out may be used)")
        walk.call(u, ("getitem",), "kosmos experts output")
        outputs[u.args[1]] = u
    if 0 not in outputs:
        raise _NoMatch(f"{call.name}: its output is unused")
    ids_shape, gu_shape = _shape(topk_ids), _shape(gate_up)
    if not ids_shape or len(ids_shape) != 2 or not gu_shape:
        raise _NoMatch(f"{call.name}: topk ids {ids_shape} / weights {gu_shape} without known shapes")
    return _Experts(hidden, topk_ids, topk_weights, gate_up, False, down, False, outputs[0], ids_shape[1],
                    gu_shape[0] * ep[1], ep)


def _expert_weight(walk: _Walk, gemm: fx.Node, what: str) -> tuple[fx.Node, bool]:
    """The grouped GEMM's weight as stored: (node [E, N, K], False) behind a transpose, or (node [E, K, N], True)."""
    w = _arg(gemm, 1, "mat2" if op_name(gemm) != "grouped_mm_fallback" else "weight")
    if op_name(w) == "transpose" and tuple(w.args[1:3]) in _TRANSPOSES:
        walk.call(w, ("transpose",), what)
        return w.args[0], False
    if op_name(w) == "permute":
        raise _NoMatch(f"{what}: weight reaches the grouped GEMM through a permute")
    return w, True


def _match_experts(walk: _Walk, down_gemm: fx.Node, up_gemm: fx.Node) -> _Experts:
    """Walks HF's grouped_mm experts forward around the down-projection grouped GEMM."""
    for g in (up_gemm, down_gemm):
        walk.call(g, _GROUPED_MM, "grouped GEMM")
        if op_name(g) != "grouped_mm_fallback" and (g.kwargs.get("bias") is not None
                                                     or g.kwargs.get("out_dtype") is not None):
            raise _NoMatch(f"{g.name}: grouped GEMM with bias or out_dtype")
    offs = _arg(down_gemm, 2, "offs")
    # offsets = cumsum(histc(sorted_ids.float()|.int(), bins=E, min=0, max=E-1), dim=0, dtype=int32)
    walk.call(offs, ("cumsum",), "offsets")
    _const(_arg(offs, 1, "dim"), 0, "offsets cumsum dim")
    histc = walk.call(offs.args[0], ("histc",), "tokens per expert")
    num_experts = _arg(histc, 1, "bins", 100)
    _const((_arg(histc, 2, "min", 0), _arg(histc, 3, "max", 0)), (0, num_experts - 1), "histc range")
    sorted_ids = walk.strip(histc.args[0], _CASTS + ("int", "long"))
    sort = walk.getitem(sorted_ids, 0, "sorted expert ids")
    walk.call(sort, ("sort",), "expert sort")
    if _arg(sort, 1, "dim", -1) not in (-1, 0) or _arg(sort, 2, "descending", False):
        raise _NoMatch(f"{sort.name}: expected an ascending sort")
    expert_ids = walk.call(sort.args[0], ("reshape", "view"), "flattened top-k ids")
    topk_ids, replicated = _match_local_ids(walk, expert_ids.args[0], num_experts)
    perm = walk.user(sort, ("getitem",), "sort permutation", exclude=(sorted_ids,))
    _const(perm.args[1], 1, "sort permutation index")

    # EP sentinels of transformers 5.17 (always present there): ge(sorted_ids, E) is all false without EP
    mask = None
    for u in list(sorted_ids.users):
        if op_name(u) == "ge":
            walk.call(u, ("ge",), "EP sentinel compare")
            _const(u.args[1], num_experts, "EP sentinel threshold")
            mask = walk.user(u, ("unsqueeze",), "EP sentinel mask")
        elif op_name(u) == "clamp_":
            walk.call(u, ("clamp_",), "EP sentinel clamp")
            _const(_arg(u, 2, "max", None), num_experts - 1, "EP sentinel clamp max")
            if _arg(u, 1, "min", None) is not None:
                raise _NoMatch(f"{u.name}: unexpected clamp min")

    def unmask(node):  # x.masked_fill(sentinel_mask, 0.0) -> x
        if mask is not None and op_name(node) == "masked_fill" and node.args[1] is mask:
            walk.call(node, ("masked_fill",), "EP sentinel fill")
            _const(node.args[2], 0.0, "EP sentinel fill value")
            return node.args[0]
        return node

    # up projection: grouped_mm(hidden[perm // k].to(W), gate_up.transpose(-2, -1), offs)
    if _arg(up_gemm, 2, "offs") is not offs:
        raise _NoMatch(f"{up_gemm.name} and {down_gemm.name} use different offsets")
    gathered = walk.strip(_arg(up_gemm, 0, "input"), _CASTS)
    walk.call(gathered, ("getitem",), "token gather")
    hidden, index = gathered.args
    if replicated:
        hidden = replicated.unwrap(walk, hidden, "identity", "all_reduce", "EP tokens")
    floordiv = walk.call(index, ("floordiv",), "token of each sorted pair")
    if floordiv.args[0] is not perm or not isinstance(floordiv.args[1], int):
        raise _NoMatch(f"{floordiv.name}: expected perm // top_k")
    top_k = floordiv.args[1]
    for u in list(gathered.users):
        if op_name(u) == "masked_fill_" and mask is not None and u.args[1] is mask:
            walk.call(u, ("masked_fill_",), "EP sentinel pre-mask")
            _const(u.args[2], 0.0, "EP sentinel pre-mask value")
    gate_up, gate_up_t = _expert_weight(walk, up_gemm, "gate_up weight")

    # SwiGLU: silu(gate) * up, with gate, up = up_out.chunk(2, dim=-1)
    act = walk.strip(_arg(down_gemm, 0, "input"), _CASTS)
    walk.call(act, ("mul",), "SwiGLU product")
    a, b = act.args
    silu, up = (a, b) if op_name(a) != "getitem" else (b, a)
    if op_name(silu) != "silu":
        raise _NoMatch(f"experts activation: expected silu(gate) * up, found {_describe(silu)} "
                       "(unsupported activation)")
    walk.call(silu, ("silu",), "SwiGLU activation")
    chunk = walk.getitem(silu.args[0], 0, "gate half")
    if walk.getitem(up, 1, "up half") is not chunk:
        raise _NoMatch(f"{act.name}: gate and up come from different tensors")
    walk.call(chunk, ("chunk",), "gate/up split")
    _const(_arg(chunk, 1, "chunks"), 2, "gate/up chunks")
    _dim_last(chunk, 2, 2, "gate/up split")
    if unmask(chunk.args[0]) is not up_gemm:
        raise _NoMatch(f"{chunk.name}: expected the gate/up split of {up_gemm.name}")
    down, down_t = _expert_weight(walk, down_gemm, "down weight")

    # weighting, inverse permutation, fold: (out * w[perm].unsqueeze(-1))[inv_perm].view(T, k, H).sum(1).to(dt)
    down_out = down_gemm
    if mask is not None:
        down_out = walk.user(down_gemm, ("masked_fill",), "EP sentinel fill")
        unmask(down_out)
    weighted = walk.user(down_out, ("mul",), "routing weights product")
    scale = weighted.args[1] if weighted.args[0] is down_out else weighted.args[0]
    walk.call(scale, ("unsqueeze",), "routing weight column")
    _dim_last(scale, 1, 2, "routing weight column")
    weights_sorted = walk.call(scale.args[0], ("getitem",), "sorted routing weights")
    if weights_sorted.args[1] is not perm:
        raise _NoMatch(f"{weights_sorted.name}: routing weights not permuted like the tokens")
    sample_weights = walk.call(weights_sorted.args[0], ("reshape", "view"), "flattened routing weights")
    topk_weights = sample_weights.args[0]
    if replicated:
        if op_name(topk_weights) == "getitem":  # transformers 5.17 sums the masked weights' gradient a second time
            topk_weights = replicated.unwrap(walk, topk_weights, "identity", "all_reduce", "EP routing weights")
            replicated.note = TRANSFORMERS_5_17_EP_NOTE
        masked = walk.call(topk_weights, ("masked_fill",), "EP off-rank routing weights")
        if masked.args[1] is not replicated.off_rank:
            raise _NoMatch(f"{masked.name}: routing weights masked with another mask than the off-rank one")
        _const(masked.args[2], 0.0, "EP off-rank routing weight")
        topk_weights = replicated.unwrap(walk, masked.args[0], "identity", "all_reduce", "EP routing weights")
    unpermuted = walk.user(weighted, ("getitem",), "inverse permutation")
    inv_perm = walk.call(unpermuted.args[1], ("empty_like",), "inverse permutation buffer")
    if inv_perm.args[0] is not perm:
        raise _NoMatch(f"{inv_perm.name}: expected empty_like(perm)")
    setitem = walk.user(inv_perm, ("setitem",), "inverse permutation scatter", exclude=(unpermuted,))
    if setitem.args[1] is not perm:
        raise _NoMatch(f"{setitem.name}: expected inv_perm[perm] = arange")
    walk.call(setitem.args[2], ("arange",), "inverse permutation values")
    view = walk.user(unpermuted, ("view", "reshape"), "fold view")
    shape = _shape(view)
    if shape is None or len(shape) != 3 or shape[1] != top_k:
        raise _NoMatch(f"{view.name}: expected [T, {top_k}, H], found {shape}")
    fold = walk.user(view, ("sum",), "fold")
    _const(_arg(fold, 1, "dim"), 1, "fold dim")
    if _arg(fold, 2, "keepdim", False):
        raise _NoMatch(f"{fold.name}: fold keeps its dim")
    output = fold
    if len(fold.users) == 1 and op_name(next(iter(fold.users))) in _CASTS:
        output = walk.user(fold, _CASTS, "output cast")
    if not replicated:
        return _Experts(hidden, topk_ids, topk_weights, gate_up, gate_up_t, down, down_t, output, top_k, num_experts)
    apply = walk.user(output, ("autograd_function_apply",), "EP output sum")
    summed = walk.user(apply, ("getitem",), "EP output sum")
    replicated.unwrap(walk, summed, "all_reduce", "identity", "EP output sum")
    all_experts, ep = _replicated_ep_group(replicated, topk_ids, num_experts)
    return _Experts(hidden, topk_ids, topk_weights, gate_up, gate_up_t, down, down_t, summed, top_k, all_experts, ep,
                    "all_reduce", replicated.note)


def _router_linear(walk: _Walk, logits: fx.Node) -> tuple[fx.Node, fx.Node, Optional[fx.Node], Optional[torch.dtype]]:
    """linear(h[.to(rd)], W[.to(rd)], b?) -> (h, W, b, rd). Under torch.autocast the linear runs in autocast's
    dtype whatever its operands' (the traced output's dtype says so): rd is then that dtype, which the op's router
    casts its operands to, as autocast does."""
    walk.call(logits, ("linear",), "router logits")
    h, w = logits.args[0], _arg(logits, 1, "weight")
    b = _arg(logits, 2, "bias", None)
    rd = None
    if op_name(h) in _CASTS or op_name(w) in _CASTS:
        if not (op_name(h) in _CASTS and op_name(w) in _CASTS) or _dtype(h) != _dtype(w):
            raise _NoMatch(f"{logits.name}: router input and weight are not cast to the same dtype")
        rd = _dtype(h)
        h, w = walk.strip(h, _CASTS), walk.strip(w, _CASTS)
        if b is not None:
            b = walk.strip(b, _CASTS)
    for n in (h, w) + ((b,) if b is not None else ()):
        if not isinstance(n, fx.Node):
            raise _NoMatch(f"{logits.name}: router operand {n!r} is not a tensor")
    traced = _dtype(logits)
    if traced is not None and traced != (rd or _dtype(h)):
        rd = traced  # autocast
    return h, w, b, rd


def strip_renorm(walk: _Walk, weights: Any) -> tuple[Any, bool]:
    """weights = values / values.sum(-1, keepdim=True) -> (values, True); anything else -> (weights, False)."""
    if op_name(weights) not in _DIVS:
        return weights, False
    walk.call(weights, _DIVS, "router renormalisation")
    values, denom = weights.args
    walk.call(denom, ("sum",), "router renormalisation sum")
    if denom.args[0] is not values or not _arg(denom, 2, "keepdim", False):
        raise _NoMatch(f"{denom.name}: expected top-k values .sum(-1, keepdim=True)")
    _dim_last(denom, 1, 2, "router renormalisation sum")
    return values, True


def _match_softmax_router(walk: _Walk, ex: _Experts):
    """Qwen3-MoE / Qwen2-MoE / OLMoE / Mixtral / DeepSeek-V2 (greedy): probs = softmax(linear(h, W), -1, fp32) (or
    softmax of the logits cast to fp32, the same math); v, i = topk(probs, k) (sorted or not: the same experts, in
    another slot order, which the op's contract leaves open); v /= v.sum(-1)?; v *= scale?; v.to(dt)?."""
    topk = walk.getitem(ex.topk_ids, 1, "router top-k ids")
    walk.call(topk, ("topk",), "router top-k")
    _const(_arg(topk, 1, "k"), ex.top_k, "router top-k k")
    _dim_last(topk, 2, 2, "router top-k")
    _const(_arg(topk, 3, "largest", True), True, "router top-k largest")
    probs = walk.call(topk.args[0], ("softmax",), "router probabilities")
    _dim_last(probs, 1, 2, "router softmax")
    if _dtype(probs) != torch.float32:
        raise _NoMatch(f"{probs.name}: router softmax in {_dtype(probs)}, expected float32")
    logits = probs.args[0]
    if op_name(logits) in _CASTS and op_name(logits.args[0]) == "linear" and _dtype(logits) == torch.float32:
        walk.call(logits, _CASTS, "router logits cast")  # softmax(x.float()) is softmax(x, dtype=float32)
        logits = logits.args[0]
    h, w, b, rd = _router_linear(walk, logits)
    weights, weights_dtype = ex.topk_weights, None
    if op_name(weights) in _CASTS:
        if _dtype(weights) != _dtype(logits):
            raise _NoMatch(f"{weights.name}: routing weights cast to {_dtype(weights)}, "
                           f"not the logits' {_dtype(logits)}")
        weights = walk.strip(weights, _CASTS)
    elif _dtype(weights) != _dtype(logits):
        if _dtype(weights) != torch.float32:
            raise _NoMatch(f"{weights.name}: routing weights in {_dtype(weights)}, neither the logits' "
                           f"{_dtype(logits)} nor the softmax's float32")
        weights_dtype = torch.float32  # Mixtral: the softmax's fp32 values, never cast back
    weights, scale = _strip_scaling(walk, weights)
    weights, norm = strip_renorm(walk, weights)
    if walk.getitem(weights, 0, "router top-k values") is not topk:
        raise _NoMatch(f"{weights.name}: routing weights are not the top-k values")
    return logits, h, w, b, None, RouterConfig(ex.top_k, "softmax", norm, routed_scaling_factor=scale,
                                               router_dtype=rd, weights_dtype=weights_dtype)


def _strip_scaling(walk: _Walk, weights: Any) -> tuple[Any, float]:
    """weights = w * s for a Python float s -> (w, s); anything else -> (weights, 1.0)."""
    if op_name(weights) != "mul":
        return weights, 1.0
    walk.call(weights, ("mul",), "routed scaling")
    a, c = weights.args
    if not isinstance(a, (int, float)) and not isinstance(c, (int, float)):
        factor = c if op_name(a) in _DIVS + ("gather", "getitem") else a
        raise _NoMatch(f"{weights.name}: the routed scaling factor {_describe(factor)} is not a constant (a "
                       "symbolic float under torch.compile(dynamic=True)?); the op needs a Python float")
    weights, scale = (a, c) if isinstance(c, (int, float)) else (c, a)
    return weights, float(scale)


def _match_grouped_router(walk: _Walk, ex: _Experts):
    """DeepSeek-V3: scores = sigmoid(linear(h.float(), W.float())); choice = scores + bias; group-limited top-k
    (groups ranked by the sum of their 2 best); w = scores.gather(ids); w /= w.sum(-1) + 1e-20; w *= scale."""
    topk = walk.getitem(ex.topk_ids, 1, "router top-k ids")
    walk.call(topk, ("topk",), "router top-k")
    _const(_arg(topk, 1, "k"), ex.top_k, "router top-k k")
    _dim_last(topk, 2, 2, "router top-k")
    _const(_arg(topk, 3, "largest", True), True, "router top-k largest")
    choice = topk.args[0]
    n_group, topk_group = 1, 1
    if op_name(choice) == "masked_fill":
        walk.call(choice, ("masked_fill",), "group mask")
        _const(choice.args[2], float("-inf"), "group mask fill")
        m = walk.call(choice.args[1], ("invert",), "group mask")
        m = walk.call(m.args[0], ("bool",), "group mask")
        m = walk.call(m.args[0], ("reshape", "view"), "group mask")
        m = walk.call(m.args[0], ("expand",), "group mask")
        m = walk.call(m.args[0], ("unsqueeze",), "group mask")
        group_mask = walk.call(m.args[0], ("zeros_like",), "group mask")
        scatter = walk.user(group_mask, ("scatter_",), "group mask scatter", exclude=(m,))
        _const((scatter.args[1], scatter.args[3]), (1, 1), "group mask scatter dim/value")
        group_topk = walk.getitem(scatter.args[2], 1, "top groups")
        walk.call(group_topk, ("topk",), "top groups")
        topk_group = _arg(group_topk, 1, "k")
        _dim_last(group_topk, 2, 2, "top groups")
        group_scores = walk.call(group_topk.args[0], ("sum",), "group scores")
        if group_mask.args[0] is not group_scores:
            raise _NoMatch(f"{group_mask.name}: expected zeros_like(group scores)")
        _dim_last(group_scores, 1, 3, "group scores")
        best2 = walk.call(walk.getitem(group_scores.args[0], 0, "best 2 of each group"), ("topk",),
                          "best 2 of each group")
        _const(_arg(best2, 1, "k"), 2, "best of each group")
        _dim_last(best2, 2, 3, "best 2 of each group")
        grouped = walk.call(best2.args[0], ("view", "reshape"), "experts by group")
        shape = _shape(grouped)
        if shape is None or len(shape) != 3:
            raise _NoMatch(f"{grouped.name}: expected [T, n_group, E / n_group], found {shape}")
        n_group = shape[1]
        masked = choice.args[0]
        if grouped.args[0] is not masked:
            raise _NoMatch(f"{grouped.name}: groups ranked on another tensor than the one masked")
        choice = masked
    bias = None
    if op_name(choice) == "add":
        walk.call(choice, ("add",), "score correction")
        a, c = choice.args
        scores, bias = (a, c) if op_name(a) in ("sigmoid", "softmax") else (c, a)
    else:
        scores = choice
    walk.call(scores, ("sigmoid", "softmax"), "router scores")
    scoring = op_name(scores)
    if scoring == "softmax":
        _dim_last(scores, 1, 2, "router softmax")
        if _dtype(scores) != torch.float32:
            raise _NoMatch(f"{scores.name}: router softmax in {_dtype(scores)}, expected float32")
    if bias is not None and (not isinstance(bias, fx.Node) or _shape(bias) is None or len(_shape(bias)) != 1):
        raise _NoMatch(f"{choice.name}: score correction {bias!r} is not a [E] tensor")
    logits = scores.args[0]
    h, w, b, rd = _router_linear(walk, logits)
    # weights: [cast] <- [mul scale] <- [div (sum + eps)] <- gather(scores, 1, ids)
    weights, norm = ex.topk_weights, False
    if op_name(weights) in _CASTS:
        if _dtype(weights) != _dtype(logits):
            raise _NoMatch(f"{weights.name}: routing weights cast to {_dtype(weights)}, "
                           f"not the logits' {_dtype(logits)}")
        weights = walk.strip(weights, _CASTS)
    if _dtype(weights) != _dtype(logits):
        raise _NoMatch(f"{weights.name}: routing weights in {_dtype(weights)}, not the logits' {_dtype(logits)}")
    weights, scale = _strip_scaling(walk, weights)
    if op_name(weights) in _DIVS:
        walk.call(weights, _DIVS, "router renormalisation")
        values, denom = weights.args
        eps = 0.0
        if op_name(denom) == "add":
            walk.call(denom, ("add",), "router renormalisation epsilon")
            denom, eps = denom.args
        _const(eps, 1e-20 if scoring == "sigmoid" else 0.0, "router renormalisation epsilon")
        walk.call(denom, ("sum",), "router renormalisation sum")
        if denom.args[0] is not values or not _arg(denom, 2, "keepdim", False):
            raise _NoMatch(f"{denom.name}: expected routing weights .sum(-1, keepdim=True)")
        _dim_last(denom, 1, 2, "router renormalisation sum")
        weights, norm = values, True
    walk.call(weights, ("gather",), "routing weights")
    if (weights.args[0] is not scores or _arg(weights, 1, "dim") not in (1, -1)
            or _arg(weights, 2, "index") is not ex.topk_ids):
        raise _NoMatch(f"{weights.name}: expected scores.gather(1, top-k ids)")
    if scoring == "softmax" and bias is None and n_group == 1:
        raise _NoMatch(f"{topk.name}: unsorted softmax top-k with gather (not a supported router form)")
    return logits, h, w, b, bias, RouterConfig(ex.top_k, scoring, norm, n_group, topk_group, scale, rd)


def _closed_region(walk: _Walk, boundary: set[fx.Node], output: fx.Node, logits: fx.Node) -> list[fx.Node]:
    """Checks the walked nodes are exactly what the output and logits depend on inside the boundary, and that
    nothing else uses them (except the output's and the logits' users); returns them."""
    walked = set(walk.nodes)
    needed, stack = set(), [output, logits] + [n for n in walked if not n.users]  # + in-place sinks
    while stack:
        n = stack.pop()
        if n in needed or n in boundary:
            continue
        if n not in walked:
            if not isinstance(_val(n), torch.Tensor) and n.op != "get_attr":
                continue  # a size (SymInt) computation under dynamic shapes: stays outside the block
            raise _NoMatch(f"block reads {_describe(n)}, which is neither one of its inputs nor part of the HF form")
        needed.add(n)
        stack.extend(n.all_input_nodes)
    unused = walked - needed
    if unused:
        raise _NoMatch(f"matched nodes {sorted(n.name for n in unused)} do not feed the block output")
    for n in needed:
        if n is output or n is logits:
            continue
        outside = [u.name for u in n.users if u not in needed]
        if outside:
            raise _NoMatch(f"block intermediate {n.name} is also used by {outside} outside the block")
    return list(needed)


def _pairs(graph: fx.Graph) -> tuple[list[tuple[fx.Node, fx.Node]], list[LeftAlone]]:
    """Grouped GEMMs sharing one offsets tensor: (up, down) pairs where the down GEMM reads the up GEMM."""
    by_offs: dict[Any, list[fx.Node]] = {}
    for n in graph.nodes:
        if op_name(n) in _GROUPED_MM and n.op == "call_function":
            if op_name(n) == "grouped_mm_fallback" and "transformers" not in str(n.target):
                continue
            if n.meta.get("kosmos_moe_reported"):  # a block an earlier MoE pass refused and recorded
                continue
            try:
                by_offs.setdefault(_arg(n, 2, "offs"), []).append(n)
            except _NoMatch:
                by_offs.setdefault(None, []).append(n)
    pairs, lone = [], []
    for offs, gemms in by_offs.items():
        if offs is not None and len(gemms) == 2:
            up, down = gemms
            pairs.append((up, down))
        else:
            lone.append(LeftAlone(
                f"grouped GEMM{'s' if len(gemms) > 1 else ''} {[g.name for g in gemms]} not in a gate_up/down pair "
                "sharing one offsets tensor (not HF grouped_mm experts)", tuple(g.name for g in gemms)))
    return pairs, lone


def find_moe_layers(graph: fx.Graph) -> tuple[list[MoeLayerMatch], list[LeftAlone], set[fx.Node]]:
    """All HF MoE blocks of the graph that kosmos::moe_layer can replace, the candidates left alone, and the nodes
    that tie a router to an experts block seen here: the top-k ids of every block whose experts matched, the
    grouped GEMMs (or kosmos call) of those whose experts did not (their reason is already in `left`)."""
    pairs, left = _pairs(graph)
    candidates = [(functools.partial(_match_experts, down_gemm=down, up_gemm=up), "grouped GEMMs not in HF grouped_mm "
                   "experts form", (up, down)) for up, down in pairs]
    candidates += [(functools.partial(_match_kosmos_experts, call=n), "expert-parallel kosmos::moe_experts",
                    (n,)) for n in graph.nodes
                   if op_name(n) == "moe_experts" and n.op == "call_function" and _arg(n, 6, "ep_group_name", None)]
    matches, claimed = [], set()
    for match_experts, what, experts_nodes in candidates:
        walk = _Walk()
        try:
            ex = match_experts(walk)
        except _NoMatch as e:
            left.append(LeftAlone(f"{what}: {e}", tuple(n.name for n in experts_nodes)))
            claimed.update(experts_nodes)
            continue
        claimed.add(ex.topk_ids)
        shapes = dict(T=_shape(ex.hidden)[0] if _shape(ex.hidden) else "?", H=(_shape(ex.hidden) or "??")[1],
                      E=ex.num_experts, k=ex.top_k, dtype=str(_dtype(ex.hidden)).replace("torch.", ""))
        router_walk = _Walk()
        router_walk.nodes.update(walk.nodes)
        try:
            probe = ex.topk_ids.args[0] if op_name(ex.topk_ids) == "getitem" else None
            if op_name(probe) == "topk" and op_name(probe.args[0]) == "softmax":
                logits, h, w, b, bias, cfg = _match_softmax_router(router_walk, ex)
            else:
                logits, h, w, b, bias, cfg = _match_grouped_router(router_walk, ex)
        except _NoMatch as e:
            left.append(LeftAlone(f"unsupported router: {e}", tuple(n.name for n in walk.nodes), shapes))
            continue
        try:
            if _root(h) is not _root(ex.hidden) or _shape(h) != _shape(ex.hidden):
                raise _NoMatch(f"router reads {h.name} {_shape(h)} but the experts gather from {ex.hidden.name} "
                               f"{_shape(ex.hidden)}")
            if _dtype(ex.output) != _dtype(h):
                raise _NoMatch(f"block output in {_dtype(ex.output)}, hidden states in {_dtype(h)}")
            gu_shape, down_shape = _shape(ex.gate_up), _shape(ex.down)
            if ex.gate_up_transposed:
                gu_shape = gu_shape[:1] + gu_shape[1:][::-1] if gu_shape else None
            if ex.down_transposed:
                down_shape = down_shape[:1] + down_shape[1:][::-1] if down_shape else None
            hdim = _shape(h)[1]
            local = ex.num_experts // ex.ep[1]
            if not gu_shape or not down_shape or gu_shape[0] != local or gu_shape[2] != hdim or \
                    down_shape != (local, hdim, gu_shape[1] // 2):
                raise _NoMatch(f"expert weights {gu_shape} / {down_shape} do not fit E={ex.num_experts}, H={hdim}")
            if _shape(w) != (ex.num_experts, hdim):
                raise _NoMatch(f"router weight {w.name} is {_shape(w)}, expected [{ex.num_experts}, {hdim}]")
            boundary = {n for n in (h, ex.hidden, w, b, bias, ex.gate_up, ex.down) if n is not None}
            nodes = _closed_region(router_walk, boundary, ex.output, logits)
        except _NoMatch as e:
            left.append(LeftAlone(str(e), tuple(n.name for n in router_walk.nodes), shapes))
            continue
        shapes["I"] = gu_shape[1] // 2
        with_logits = any(u not in set(nodes) for u in logits.users)
        matches.append(MoeLayerMatch(h, w, b, bias, ex.gate_up, ex.gate_up_transposed, ex.down, ex.down_transposed,
                                     cfg, ex.output, logits, nodes, shapes, with_logits, ex.hidden, ex.ep, ex.ep_mode,
                                     ex.ep_note))
    return matches, left, claimed


def _reaches_reported_gemm(topk: fx.Node, refused: set, limit: int = 200) -> bool:
    """The top-k's data reaches, within `limit` nodes, a grouped GEMM whose block was refused with its reason: by
    an earlier MoE pass (node meta) or by this one (`refused`)."""
    seen, frontier = {topk}, [topk]
    while frontier and len(seen) < limit:
        n = frontier.pop(0)
        if n.meta.get("kosmos_moe_reported") or n in refused:
            return True
        for u in n.users:
            if u not in seen:
                seen.add(u)
                frontier.append(u)
    return False


def find_unmatched_routers(graph: fx.Graph, claimed: set[fx.Node]) -> list[LeftAlone]:
    """Routers (2-D linear -> softmax/sigmoid -> ... -> topk) whose top-k no grouped GEMM pair claimed: their
    experts are not in HF's grouped_mm form (experts_implementation 'eager' or 'batched_mm', or own MoE code)."""
    left = []
    for n in graph.nodes:
        if op_name(n) != "linear" or len(_shape(n) or ()) != 2:
            continue
        frontier, seen, found = [n], set(), None
        for _ in range(8):
            frontier = [u for f in frontier for u in f.users if u not in seen]
            seen.update(frontier)
            if found is None:
                found = next((u for u in frontier if op_name(u) == "topk"), None)
        if found is None or not any(op_name(x) in ("softmax", "sigmoid") for x in seen) or seen & claimed:
            continue
        if any(op_name(x) == "moe_experts" for x in seen):  # experts_implementation="kosmos": already one kosmos call
            continue
        if _reaches_reported_gemm(found, claimed):  # its experts block was refused, with its reason
            continue
        left.append(LeftAlone(
            f"router {n.name} -> {found.name} without HF grouped_mm experts (the experts implementation is not "
            f"'grouped_mm'); {_EXPERTS_HINT}", (n.name, found.name),
            dict(T=(_shape(n) or "?")[0], E=(_shape(n) or "??")[1])))
    return left


def planned_impl(call: fx.Node) -> tuple[str, str]:
    """("fused" | "reference", reason) for a kosmos::moe_layer call node, judged on its arguments' fake values
    (the run-time choice is recorded again at each call)."""
    from kosmos.ops import dispatch

    args = fx.node.map_arg(call.args, _val)
    v = args[0]
    device = v.device if isinstance(v, torch.Tensor) else torch.device("cpu")
    reason = dispatch.why_reference("moe_layer", device, *args)
    return ("reference", reason) if reason else ("fused", "supported")


def run(gm: fx.GraphModule, example_inputs, options) -> int:
    """Rewrites every matched MoE block of `gm` into one kosmos::moe_layer call; returns how many."""
    graph = gm.graph
    matches, left, claimed = find_moe_layers(graph)
    done = 0
    for m in matches:
        try:
            call = m.replace(graph)
        except _NoMatch as e:
            left.append(LeftAlone(str(e), tuple(n.name for n in m.nodes), m.shapes))
            continue
        m.erase(graph)
        m.record(*planned_impl(call))
        done += 1
    left += find_unmatched_routers(graph, claimed)
    for la in left:
        la.record()
    if done:
        graph.lint()
        gm.recompile()
    return done
