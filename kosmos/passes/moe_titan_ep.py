"""Pre-grad pass: torchtitan-style all-to-all expert-parallel MoE blocks -> one expert-parallel kosmos::moe_layer call.

The form (torchtitan MoE + ExpertParallel, tests/ep_moe_models.py TitanEpMoE), traced into ONE Dynamo graph with
`torch._dynamo.config.capture_scalar_outputs = True` (without it Dynamo breaks the graph at `.tolist()`, and
kosmos.passes.moe_ep_forms reports the halves):

    scores = softmax(linear(x, W), -1, dtype=float32); top_scores, ids = topk(scores, k)   [/ sum] [* scale]
    flat = ids.view(-1); counts = histc(flat.float(), bins=E, min=0, max=E-1).long(); order = argsort(flat)
    recv_counts = wait(all_to_all_single(counts, [E_loc] * ep, [E_loc] * ep, group))           # count exchange
    send = counts.view(ep, E_loc).sum(1); recv = recv_counts.view(ep, E_loc).sum(1)
    in_splits, out_splits = [send[i].item() ...], [recv[i].item() ...]                         # .tolist()
    received = wait(all_to_all_single(x[order // k], out_splits, in_splits, group))            # dispatch
    perm = argsort(arange(E_loc).repeat(ep).repeat_interleave(recv_counts.view(-1)))          # by local expert
    offs = cumsum(recv_counts.view(ep, E_loc).sum(0), 0, dtype=int32); h = received[perm]
    y = grouped_mm(silu(grouped_mm(h, w1.T, offs)) * grouped_mm(h, w3.T, offs), w2.T, offs)
    buf = empty_like(y); buf[perm] = y
    returned = wait(all_to_all_single(buf, in_splits, out_splits, group))                      # combine
    per_slot = empty_like(returned); per_slot[order] = returned
    out = (per_slot.view(T, k, H) * top_scores.unsqueeze(-1).to(dt)).sum(1)

becomes `moe_layer(x, W, None, None, cat([w1, w3], 1), w2, k, "softmax", renorm, 1, 1, scale, None, "silu", ...,
group, ep)`: w1 is the gate half, w3 the up half (the op splits gate_up's output rows gate-first); the inserted
`torch.cat` gives w1 and w3 their gradients through autograd. The group name comes from the collectives (all three
must use the same one), the EP size from the resolved process group; E (router rows, histc bins) must be
E_loc * ep.

Anchor: three grouped GEMMs sharing one offsets tensor in a graph that has all_to_all_single collectives. The walk
goes node by node from the GEMMs out to the router and the fold, checking ops and constants (helpers and the
closed-region check of kosmos.passes.moe). The split sizes are unbacked SymInts (`item` of the count sums); the
runtime asserts Dynamo put on them and the SymInt arithmetic (`sym_sum`) belong to the block; a block whose sizes are
used by a node outside it is left alone. Candidates that fail a check are recorded (kind "moe_layer", not
rewritten) with the reason.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from kosmos.passes.autograd_fn import autograd_fn_kind, tensor_input
from kosmos.passes.moe import (
    _CASTS, KIND, LeftAlone, RouterConfig, _arg, _closed_region, _const, _describe, _dim_last, _dtype,
    _expert_weight, _new, _NoMatch, _root, _router_linear, _shape, _val, _Walk, emit_moe_layer,
    insertion_point, op_name, planned_impl, strip_renorm)
from kosmos.reporting import PassRecord, record

_GRAPH = "pre-grad"
_GROUPED_MM = ("_grouped_mm",)
_A2A = "all_to_all_single"
_VIEWS = ("view", "reshape")
_SCALARS = ("item", "_local_scalar_dense")  # what `.tolist()` becomes under capture_scalar_outputs
_WHAT = "torchtitan-style all-to-all EP MoE"
REPORTED = "kosmos_moe_reported"  # node.meta key on the grouped GEMMs of a candidate refused (and recorded) here


@dataclasses.dataclass
class TitanEpMatch:
    """One torchtitan-style EP MoE block, with its inputs and its one output."""

    hidden: fx.Node  # [T, H] this rank's tokens
    router_weight: fx.Node  # [E, H], replicated
    w1: fx.Node  # [E_loc, I, H] (or [E_loc, H, I] if w1_transposed), the gate projection
    w3: fx.Node  # the up projection, like w1
    w2: fx.Node  # [E_loc, H, I] (or [E_loc, I, H] if w2_transposed)
    transposed: tuple[bool, bool, bool]  # w1, w3, w2 stored as the grouped GEMM's own operand
    router: RouterConfig
    group_name: str
    world_size: int
    output: fx.Node  # the folded [T, H] output
    logits: fx.Node  # the router logits [T, E]
    nodes: list[fx.Node]  # every node the op replaces
    shapes: dict
    with_logits: bool = False

    def inputs(self) -> list[fx.Node]:
        return [self.hidden, self.router_weight, self.w1, self.w3, self.w2]

    def replace(self, graph: fx.Graph) -> fx.Node:
        """Inserts cat(w1, w3) and the kosmos::moe_layer call after the last of the inputs; rewires the output."""
        region = set(self.nodes)
        with graph.inserting_before(insertion_point(graph, self.inputs(), self.logits, region)):
            w1, w3, w2 = (_new(graph, "call_method", "transpose", (w, -2, -1), like=self.output) if t else w
                          for w, t in zip((self.w1, self.w3, self.w2), self.transposed))
            gate_up = _new(graph, "call_function", torch.cat, ([w1, w3], 1), like=self.output)
            _fake(gate_up)
            args = (self.hidden, self.router_weight, None, None, gate_up, w2, self.router.top_k, self.router.scoring,
                    self.router.norm_topk_prob, 1, 1, self.router.routed_scaling_factor, self.router.router_dtype,
                    "silu", self.with_logits, self.group_name, self.world_size, "all_to_all")
            return emit_moe_layer(graph, args, self.output, self.logits, self.with_logits, region)

    def erase(self, graph: fx.Graph) -> None:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        for node in sorted(self.nodes, key=pos.__getitem__, reverse=True):
            graph.erase_node(node)

    def record(self, impl: str, impl_reason: str) -> None:
        record(PassRecord(
            kind=KIND, graph=_GRAPH, rewritten=True,
            reason=f"{_WHAT}: router ({self.router.text()}) + token-count exchange + dispatch/combine "
            "all_to_all_single + grouped_mm SwiGLU experts (w1, w3, w2) + fold -> kosmos::moe_layer"
            + (" (returns router logits)" if self.with_logits else "")
            + f" (expert parallel: group {self.group_name}, {self.world_size} ranks)",
            nodes=tuple(n.name for n in self.nodes), shapes=self.shapes, impl=impl, impl_reason=impl_reason,
        ))


def _fake(node: fx.Node) -> None:
    """Sets node's example_value by running its target on its inputs' fake values."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _val)
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    modes = {id(a.fake_mode): a.fake_mode for a in flat if hasattr(a, "fake_mode")}
    if len(modes) == 1:
        with next(iter(modes.values())):
            node.meta["example_value"] = node.target(*args, **kwargs)


# ------------------------------------------------------------------------------------------ matching


def _ascending_argsort(walk: _Walk, node: Any, what: str) -> fx.Node:
    walk.call(node, ("argsort",), what)
    if _arg(node, 1, "dim", -1) not in (-1, 0) or _arg(node, 2, "descending", False):
        raise _NoMatch(f"{what}: expected an ascending argsort of a 1-D tensor, found {_describe(node)}")
    return node


def _is_wait_fn(node: Any) -> bool:
    """node = autograd_function_apply(...) of a function waiting forward, passing the gradient through backward:
    torch 2.11's `all_to_all_single_autograd` waits inside such a function (`_FromTorchTensor`)."""
    return (autograd_fn_kind(node) or ())[:2] == ("wait", "identity")


def _claim_wait_fn(walk: _Walk, apply: fx.Node, result: fx.Node, what: str) -> None:
    """Adds the wait function and its body get_attrs to the walk; its result must be its only user."""
    if list(apply.users) != [result]:
        raise _NoMatch(f"{what} wait: {apply.name} has other users than {result.name}")
    walk.nodes.update(dict.fromkeys([apply, *apply.args[:2]]))


def _wait_a2a(walk: _Walk, node: Any, what: str) -> fx.Node:
    """node = wait_tensor(all_to_all_single(...)) or its autograd.Function form; returns the all_to_all_single."""
    if op_name(node) == "getitem" and _is_wait_fn(node.args[0]):
        apply = walk.getitem(node, 0, f"{what} wait")
        _claim_wait_fn(walk, apply, node, what)
        return walk.call(tensor_input(apply), (_A2A,), what)
    walk.call(node, ("wait_tensor",), f"{what} wait")
    return walk.call(node.args[0], (_A2A,), what)


def _waited(walk: _Walk, a2a: fx.Node, what: str) -> fx.Node:
    """The waited result of `a2a`: its wait_tensor user, or output 0 of the autograd.Function form."""
    users = list(a2a.users)
    if len(users) != 1 or not _is_wait_fn(users[0]):
        return walk.user(a2a, ("wait_tensor",), f"{what} wait")
    apply = users[0]
    result = walk.user(apply, ("getitem",), f"{what} wait")
    _const(result.args[1], 0, f"{what} wait output")
    _claim_wait_fn(walk, apply, result, what)
    return result


def _splits(walk: _Walk, sizes: Any, counts: fx.Node, ep: int, e_loc: int, what: str) -> None:
    """sizes = [t[0].item(), ..., t[ep-1].item()] with t = counts.view(ep, E_loc).sum(1) (per-rank sums of the
    per-expert counts: `t.tolist()` under capture_scalar_outputs)."""
    if not isinstance(sizes, (list, tuple)) or len(sizes) != ep:
        raise _NoMatch(f"{what}: expected {ep} split sizes read from the token counts, found {sizes!r}")
    sums = None
    for i, s in enumerate(sizes):
        if not isinstance(s, fx.Node):
            raise _NoMatch(f"{what}: split size {i} is the constant {s!r}, not read from the token counts")
        walk.call(s, _SCALARS, f"{what} {i} (.tolist())")
        src = walk.getitem(s.args[0], i, f"{what} {i}")
        if sums is not None and src is not sums:
            raise _NoMatch(f"{what}: split sizes read from {sums.name} and {src.name}")
        sums = src
    walk.call(sums, ("sum",), f"{what} per rank")
    _const(_arg(sums, 1, "dim"), 1, f"{what} per rank sum dim")
    _const(_arg(sums, 2, "keepdim", False), False, f"{what} per rank sum keepdim")
    view = walk.call(sums.args[0], _VIEWS, f"{what} by rank")
    if view.args[0] is not counts or _shape(view) != (ep, e_loc):
        raise _NoMatch(f"{what}: expected {counts.name}.view({ep}, {e_loc}), found {_describe(view)} {_shape(view)}")


def _setitem_scatter(walk: _Walk, value: fx.Node, index: fx.Node, what: str) -> fx.Node:
    """buf = empty_like(value); buf[index] = value -> buf."""
    sets = [u for u in value.users if op_name(u) == "setitem" and u.args[2] is value]
    bufs = [u for u in value.users if op_name(u) == "empty_like"]
    if len(sets) != 1 or len(bufs) != 1 or len(value.users) != 2:
        raise _NoMatch(f"{what}: expected buf = empty_like({value.name}); buf[index] = {value.name}, found users "
                       f"{[u.name for u in value.users]}")
    (setitem,), (buf,) = sets, bufs
    walk.call(buf, ("empty_like",), what)
    walk.call(setitem, ("setitem",), what)
    if setitem.args[0] is not buf or setitem.args[1] is not index:
        raise _NoMatch(f"{what}: expected {buf.name}[{index.name}] = {value.name}, found {_describe(setitem)}")
    return buf


def _fold_weights(walk: _Walk, column: Any, topk: fx.Node, logits: fx.Node) -> tuple[bool, float]:
    """column = top_scores [/ sum] [* scale] .unsqueeze(-1) [.to(dt)] (casts on either side of the unsqueeze);
    returns (renormalised, scale). The weights must reach the product in the logits' dtype (the op's contract)."""
    if _dtype(column) != _dtype(logits):
        raise _NoMatch(f"{_describe(column)}: routing weights reach the fold in {_dtype(column)}, not the router "
                       f"logits' {_dtype(logits)} (kosmos::moe_layer casts the weights to the logits' dtype)")
    node = walk.strip(column, _CASTS)
    walk.call(node, ("unsqueeze",), "routing weight column")
    _dim_last(node, 1, 3, "routing weight column")
    weights = walk.strip(node.args[0], _CASTS)
    scores_dtype = _dtype(weights)
    scale = 1.0
    if op_name(weights) == "mul":
        walk.call(weights, ("mul",), "route scale")
        a, c = weights.args
        if not isinstance(a, (int, float)) and not isinstance(c, (int, float)):
            raise _NoMatch(f"{weights.name}: the route scale is not a Python constant")
        weights, scale = (a, float(c)) if isinstance(c, (int, float)) else (c, float(a))
    weights, norm = strip_renorm(walk, weights)
    if walk.getitem(weights, 0, "router top-k values") is not topk:
        raise _NoMatch(f"{_describe(weights)}: routing weights are not the top-k values (or a renormalisation / "
                       "constant scaling of them)")
    if scores_dtype != torch.float32:
        raise _NoMatch(f"{weights.name}: routing weights handled in {scores_dtype} before the cast, expected float32")
    return norm, scale


def _match(walk: _Walk, gemms: list[fx.Node]) -> TitanEpMatch:
    # experts: h1 = gmm(h, w1.T), h3 = gmm(h, w3.T), y = gmm(silu(h1) * h3, w2.T), all on one offsets tensor
    for g in gemms:
        walk.call(g, _GROUPED_MM, "grouped GEMM")
        if _arg(g, 3, "bias", None) is not None or _arg(g, 4, "out_dtype", None) is not None:
            raise _NoMatch(f"{g.name}: grouped GEMM with bias or out_dtype")
    tokens = [_arg(g, 0, "mat_a") for g in gemms]
    ups = [g for g, t in zip(gemms, tokens) if tokens.count(t) == 2]
    downs = [g for g, t in zip(gemms, tokens) if tokens.count(t) == 1]
    if len(ups) != 2 or len(downs) != 1:
        raise _NoMatch(f"grouped GEMMs {[g.name for g in gemms]}: expected two on the same tokens (w1, w3) and one on "
                       "their product (w2)")
    (down,) = downs
    act = walk.call(_arg(down, 0, "mat_a"), ("mul",), "SwiGLU product")
    a, b = act.args
    silu, up = (a, b) if op_name(a) == "silu" else (b, a)
    if op_name(silu) != "silu" or {silu.args[0], up} != set(ups):
        raise _NoMatch(f"experts activation: expected silu(h @ w1.T) * (h @ w3.T), found {_describe(a)} * "
                       f"{_describe(b)} (kosmos::moe_layer has activation 'silu' only)")
    walk.call(silu, ("silu",), "SwiGLU activation")
    if _arg(silu, 1, "inplace", False):
        raise _NoMatch(f"{silu.name}: in-place silu")
    gate = silu.args[0]
    (w1, t1), (w3, t3), (w2, t2) = (_expert_weight(walk, g, n) for g, n in ((gate, "w1"), (up, "w3"), (down, "w2")))
    offs = _arg(down, 2, "offs")
    if any(_arg(g, 2, "offs") is not offs for g in gemms):
        raise _NoMatch("the grouped GEMMs use different offsets")

    # offsets = cumsum(recv_counts.view(ep, E_loc).sum(0), 0, dtype=int32)
    walk.call(offs, ("cumsum",), "offsets")
    _const(_arg(offs, 1, "dim"), 0, "offsets cumsum dim")
    if _dtype(offs) != torch.int32:
        raise _NoMatch(f"{offs.name}: offsets in {_dtype(offs)}, expected int32")
    per_expert = walk.call(offs.args[0], ("sum",), "tokens per local expert")
    _const((_arg(per_expert, 1, "dim"), _arg(per_expert, 2, "keepdim", False)), (0, False),
           "tokens per local expert sum")
    by_rank = walk.call(per_expert.args[0], _VIEWS, "received counts by rank")
    recv_counts = by_rank.args[0]
    shape = _shape(by_rank)
    if shape is None or len(shape) != 2 or _shape(recv_counts) != (shape[0] * shape[1],):
        raise _NoMatch(f"{by_rank.name}: expected received counts [E].view(ep, E_loc), found {_shape(recv_counts)} -> "
                       f"{shape}")
    ep, e_loc = shape
    num_experts = ep * e_loc
    # count exchange: recv_counts = wait(all_to_all_single(counts, [E_loc] * ep, [E_loc] * ep, group))
    count_a2a = _wait_a2a(walk, recv_counts, "token-count all_to_all_single")
    _const((list(_arg(count_a2a, 1, "output_split_sizes")), list(_arg(count_a2a, 2, "input_split_sizes"))),
           ([e_loc] * ep, [e_loc] * ep), "token-count all_to_all_single splits")
    counts = count_a2a.args[0]
    histc = walk.call(walk.strip(counts, _CASTS + ("long", "int")), ("histc",), "tokens per expert")
    _const((_arg(histc, 1, "bins", 100), _arg(histc, 2, "min", 0), _arg(histc, 3, "max", 0)),
           (num_experts, 0, num_experts - 1), "histc bins/min/max")
    flat_ids = walk.call(walk.strip(histc.args[0], _CASTS + ("long", "int")), _VIEWS, "flattened top-k ids")
    if _shape(flat_ids) is None or len(_shape(flat_ids)) != 1:
        raise _NoMatch(f"{flat_ids.name}: expected the top-k ids flattened, found {_shape(flat_ids)}")
    topk = walk.getitem(flat_ids.args[0], 1, "router top-k ids")

    # local permute: perm = argsort(arange(E_loc).repeat(ep).repeat_interleave(recv_counts.view(-1)));
    # h = received[perm]
    h = _arg(ups[0], 0, "mat_a")
    walk.call(h, ("getitem",), "tokens by local expert")
    received, perm = h.args
    _ascending_argsort(walk, perm, "local expert permutation")
    local_ids = walk.call(perm.args[0], ("repeat_interleave",), "local expert of each received row")
    repeats = walk.call(_arg(local_ids, 1, "repeats"), _VIEWS, "received counts")
    if repeats.args[0] is not recv_counts or _shape(repeats) != (num_experts,):
        raise _NoMatch(f"{repeats.name}: expected {recv_counts.name}.view(-1)")
    tiled = walk.call(local_ids.args[0], ("repeat",), "local expert ids per source rank")
    _const(tuple(tiled.args[1:]), (ep,), "local expert ids repeat")
    arange = walk.call(tiled.args[0], ("arange",), "local expert ids")
    if tuple(arange.args) not in ((e_loc,), (0, e_loc)) or set(arange.kwargs) - {"device", "dtype"} or \
            _dtype(arange) != torch.int64:
        raise _NoMatch(f"{arange.name}: expected arange({e_loc}), found {_describe(arange)} {arange.args}")

    # dispatch: received = wait(all_to_all_single(x[order // k], out_splits, in_splits, group))
    dispatch = _wait_a2a(walk, received, "dispatch all_to_all_single")
    routed = walk.call(walk.strip(dispatch.args[0], _CASTS), ("getitem",), "routed tokens")
    hidden, index = routed.args
    floordiv = walk.call(index, ("floordiv",), "token of each sorted pair")
    order, top_k = floordiv.args
    _ascending_argsort(walk, order, "expert sort")
    if order.args[0] is not flat_ids:
        raise _NoMatch(f"{order.name}: expected argsort of {flat_ids.name}")
    _splits(walk, _arg(dispatch, 2, "input_split_sizes"), counts, ep, e_loc, "dispatch input splits")
    _splits(walk, _arg(dispatch, 1, "output_split_sizes"), recv_counts, ep, e_loc, "dispatch output splits")

    # combine: buf[perm] = y; returned = wait(all_to_all_single(buf, in_splits, out_splits, group)); unsort; fold
    buf = _setitem_scatter(walk, down, perm, "local expert unpermute")
    combine = walk.user(buf, (_A2A,), "combine all_to_all_single",
                        exclude=[u for u in buf.users if op_name(u) == "setitem"])
    if [list(_arg(combine, i, n)) for i, n in ((1, "output_split_sizes"), (2, "input_split_sizes"))] != \
            [list(_arg(dispatch, 2, "input_split_sizes")), list(_arg(dispatch, 1, "output_split_sizes"))]:
        raise _NoMatch(f"{combine.name}: combine splits are not the dispatch splits swapped")
    returned = _waited(walk, combine, "combine all_to_all_single")
    per_slot = _setitem_scatter(walk, returned, order, "expert unsort")
    view = walk.user(per_slot, _VIEWS, "fold view", exclude=[u for u in per_slot.users if op_name(u) == "setitem"])
    product = view
    if len(view.users) == 1 and op_name(next(iter(view.users))) in _CASTS:  # the dtype checks below judge it
        product = walk.user(view, _CASTS, "fold cast")
    product = walk.user(product, ("mul",), "routing weights product")
    fold = walk.user(product, ("sum",), "fold")
    _const((_arg(fold, 1, "dim"), _arg(fold, 2, "keepdim", False)), (1, False), "fold sum dim/keepdim")
    output = fold
    if len(fold.users) == 1 and op_name(next(iter(fold.users))) in _CASTS:
        output = walk.user(fold, _CASTS, "output cast")

    # router: softmax(linear(x, W), -1, float32) -> topk(k) (largest, sorted)
    walk.call(topk, ("topk",), "router top-k")
    _const(_arg(topk, 1, "k"), top_k, "router top-k k (the dispatch's order // k)")
    _dim_last(topk, 2, 2, "router top-k")
    _const((_arg(topk, 3, "largest", True), _arg(topk, 4, "sorted", True)), (True, True), "router top-k largest/sorted")
    probs = walk.call(topk.args[0], ("softmax",), "router scores")
    _dim_last(probs, 1, 2, "router softmax")
    if _dtype(probs) != torch.float32:
        raise _NoMatch(f"{probs.name}: router softmax in {_dtype(probs)}, expected float32")
    logits = probs.args[0]
    rh, router_weight, bias, rd = _router_linear(walk, logits)
    if bias is not None:
        raise _NoMatch(f"{logits.name}: router with a bias")
    column = product.args[1] if walk.strip(product.args[0], _CASTS) is view else product.args[0]
    norm, scale = _fold_weights(walk, column, topk, logits)

    # shapes, dtypes, group
    T, H = _shape(hidden) or (None, None)
    if _root(rh) is not _root(hidden) or _shape(rh) != _shape(hidden):
        raise _NoMatch(f"router reads {rh.name} {_shape(rh)} but the dispatch sends rows of "
                       f"{hidden.name} {_shape(hidden)}")
    if _shape(view) != (T, top_k, H):
        raise _NoMatch(f"{view.name}: expected [T={T}, k={top_k}, H={H}], found {_shape(view)}")
    wdt = {_dtype(w) for w in (w1, w3, w2)}
    if len(wdt) != 1 or _dtype(hidden) not in wdt:
        raise _NoMatch(f"hidden in {_dtype(hidden)}, w1/w3/w2 in {[_dtype(w) for w in (w1, w3, w2)]}: "
                       "expected one dtype")
    (wdtype,) = wdt
    lt = _dtype(logits)
    if _dtype(product) != torch.promote_types(wdtype, lt):
        raise _NoMatch(f"{product.name}: fold product in {_dtype(product)}, kosmos::moe_layer's is in "
                       f"promote({wdtype}, {lt})")
    if _dtype(output) != _dtype(hidden):
        raise _NoMatch(f"block output in {_dtype(output)}, hidden states in {_dtype(hidden)}")
    s1, s3, s2 = (_shape(w) for w in (w1, w3, w2))
    if t1:
        s1 = s1[:1] + s1[1:][::-1] if s1 else None
    if t3:
        s3 = s3[:1] + s3[1:][::-1] if s3 else None
    if t2:
        s2 = s2[:1] + s2[1:][::-1] if s2 else None
    if not s1 or s1 != s3 or s1[0] != e_loc or s1[2] != H or s2 != (e_loc, H, s1[1]):
        raise _NoMatch(f"expert weights w1 {s1} / w3 {s3} / w2 {s2} do not fit E_loc={e_loc}, H={H}")
    if _shape(router_weight) != (num_experts, H):
        raise _NoMatch(f"router weight {router_weight.name} is {_shape(router_weight)}, expected "
                       f"[E={num_experts} = {e_loc} local x {ep} ranks, H={H}]")
    names = {_arg(n, 3, "group_name") for n in (count_a2a, dispatch, combine)}
    if len(names) != 1 or not isinstance(next(iter(names)), str):
        raise _NoMatch(f"the all_to_all_single collectives use groups {sorted(map(repr, names))}, "
                       "expected one group name")
    (group_name,) = names
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        world = _resolve_process_group(group_name).size()
    except Exception as e:  # noqa: BLE001 - any failure to resolve means we cannot vouch for the group
        raise _NoMatch(f"process group {group_name!r} of the collectives does not resolve: {e}") from None
    if world != ep:
        raise _NoMatch(f"group {group_name!r} has {world} ranks but the counts are laid out for {ep} "
                       f"(E={num_experts}, E_loc={e_loc})")
    cfg = RouterConfig(top_k, "softmax", norm, routed_scaling_factor=scale, router_dtype=rd)
    shapes = dict(T=T, H=H, E=num_experts, E_loc=e_loc, k=top_k, I=s1[1], ep=ep,
                  dtype=str(_dtype(hidden)).replace("torch.", ""))
    return TitanEpMatch(hidden, router_weight, w1, w3, w2, (t1, t3, t2), cfg, group_name, ep, output, logits, [],
                        shapes)


def _scalar_closure(walk: _Walk) -> None:
    """Adds the non-tensor users (SymInt arithmetic, the runtime asserts Dynamo put on the unbacked split sizes) of
    the walked scalar nodes to the walk."""
    stack = [n for n in walk.nodes if op_name(n) in _SCALARS]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in walk.nodes and u.op == "call_function" and not isinstance(_val(u), torch.Tensor):
                walk.nodes[u] = None
                stack.append(u)


def _unbacked(value) -> set:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # noqa: BLE001 - values free_unbacked_symbols does not know carry no symbols
        return set()


def _check_symbols(graph: fx.Graph, region: set[fx.Node]) -> None:
    """No node left in the graph may use a data-dependent size (unbacked symbol) defined inside the block."""
    defined = set()
    for n in region:
        if op_name(n) in _SCALARS:
            defined |= _unbacked(_val(n))
        defined |= set((n.meta.get("unbacked_bindings") or {}).keys())
    if not defined:
        return
    users = [(n.name, sorted(map(str, _unbacked(_val(n)) & defined))) for n in graph.nodes
             if n not in region and _unbacked(_val(n)) & defined]
    if users:
        raise _NoMatch(f"nodes outside the block use its data-dependent split sizes: {users}")


def _triples(graph: fx.Graph) -> list[list[fx.Node]]:
    """Grouped GEMMs sharing one offsets tensor, three to a group, if the graph has all_to_all_single collectives."""
    if not any(op_name(n) == _A2A and n.op == "call_function" for n in graph.nodes):
        return []
    by_offs: dict[Any, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and op_name(n) in _GROUPED_MM:
            offs = n.kwargs.get("offs", n.args[2] if len(n.args) > 2 else None)
            if isinstance(offs, fx.Node):
                by_offs.setdefault(offs, []).append(n)
    return [g for g in by_offs.values() if len(g) == 3]


def find_titan_ep_moe(graph: fx.Graph) -> tuple[list[TitanEpMatch], list[LeftAlone]]:
    """The torchtitan-style EP MoE blocks of `graph` that kosmos::moe_layer can replace, and the candidates left
    alone (three grouped GEMMs on one offsets tensor, in a graph with all_to_all_single, that fail a check)."""
    matches, left = [], []
    for gemms in _triples(graph):
        walk = _Walk()
        try:
            m = _match(walk, gemms)
            _scalar_closure(walk)
            m.nodes = _closed_region(walk, {m.hidden, m.router_weight, m.w1, m.w3, m.w2}, m.output, m.logits)
            _check_symbols(graph, set(m.nodes))
        except _NoMatch as e:
            left.append(LeftAlone(f"{_WHAT}: {e}", tuple(n.name for n in walk.nodes) or tuple(g.name for g in gemms)))
            for g in gemms:  # this reason is the one that counts: later MoE passes do not report these GEMMs again
                g.meta[REPORTED] = True
            continue
        m.with_logits = any(u not in set(m.nodes) for u in m.logits.users)
        matches.append(m)
    return matches, left


def run(gm: fx.GraphModule, example_inputs, options) -> int:
    """Rewrites every torchtitan-style EP MoE block of `gm` into one kosmos::moe_layer call; returns how many."""
    graph = gm.graph
    matches, left = find_titan_ep_moe(graph)
    done = 0
    for m in matches:
        try:
            call = m.replace(graph)
        except _NoMatch as e:
            left.append(LeftAlone(f"{_WHAT}: {e}", tuple(n.name for n in m.nodes), m.shapes))
            continue
        m.erase(graph)
        m.record(*planned_impl(call))
        done += 1
    for la in left:
        la.record()
    if done:
        graph.lint()
        gm.recompile()
    return done
