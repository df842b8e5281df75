"""Reference math of the MoE ops (kosmos.ops.moe, whose docstring states the semantics): the router and its
backward, ragged grouped matmuls, the experts over the (token, slot) pairs sorted by expert, and the expert-parallel
forms over torch.distributed. Single steps run as CUDA row kernels where kosmos.kernels registered them
(kosmos.ops.dispatch.row_kernel); the torch math is the definition."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F

from kosmos.kernels import runtime
from kosmos.ops import dispatch
from kosmos.ops.split_mm import fp32_mm

_SIGMOID_NORM_EPS = 1e-20  # DeepSeek-V3's renormalisation epsilon


# ------------------------------------------------------------------------------------ reference math


def _route_forward(hidden, router_weight, router_bias, score_correction_bias, top_k, scoring, norm_topk_prob,
                   n_group, topk_group, routed_scaling_factor, router_dtype, ids=None, logits=None,
                   weights_dtype=None, kernels=True):
    """The router of the module docstring, keeping what its backward needs. ids [T, k] given: those choices
    instead of the top-k selection (the weights are the scores gathered there, normalised and scaled as usual; on
    CUDA by the registered row kernel where it takes them, whose state keeps no scores: _router_d_logits's kernel
    recomputes them). logits given: the router GEMM's output (then the state keeps hidden uncast: route_backward
    wants it cast to router_dtype, which the caller does when it needs it). weights_dtype: the weights' dtype
    (None: the logits'). kernels=False: torch's ops only."""
    # which fp32 operands hold bf16 values (split_mm takes them as one part)
    exact = dict(weight_exact=router_weight.dtype == torch.bfloat16, hidden_exact=hidden.dtype == torch.bfloat16,
                 hidden_dtype=hidden.dtype)
    hidden, router_weight, logits = _router_linear(hidden, router_weight, router_bias, router_dtype, logits)
    eps = _SIGMOID_NORM_EPS if scoring == "sigmoid" else 0.0
    kernel = dispatch.row_kernel("moe_route_weights", logits.device) if ids is not None and kernels else None
    weights = (kernel(logits, ids, scoring, norm_topk_prob, routed_scaling_factor, eps, weights_dtype)
               if kernel else None)
    if weights is not None:
        kept = dict(norm_topk_prob=norm_topk_prob, eps=eps, top_k=top_k)
        return logits, ids, weights, dict(hidden=hidden, router_weight=router_weight, scores=None, kept=kept, **exact)
    if scoring == "softmax":
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = logits.sigmoid()
    if ids is not None:
        ids = ids.long()
        raw = scores.gather(1, ids)
    elif scoring == "softmax" and score_correction_bias is None and n_group == 1:
        raw, ids = torch.topk(scores, top_k, dim=-1)
    else:
        num_experts = scores.shape[-1]
        choice = scores + score_correction_bias if score_correction_bias is not None else scores
        if n_group > 1:
            group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        raw = scores.gather(1, ids)
    normed, denominator = raw, None
    if norm_topk_prob:
        denominator = raw.sum(dim=-1, keepdim=True)
        if eps:
            denominator = denominator + eps
        normed = raw / denominator
    scaled = scoring == "sigmoid" or routed_scaling_factor != 1.0
    weights = normed * routed_scaling_factor if scaled else normed
    state = dict(hidden=hidden, router_weight=router_weight, scores=scores, normed=normed, denominator=denominator,
                 scaled=scaled, **exact)
    return logits, ids, weights.to(weights_dtype or logits.dtype), state


def _router_linear(hidden, router_weight, router_bias, router_dtype, logits=None):
    """(hidden, router_weight) cast to router_dtype (hidden left as it is if logits are given) and the logits
    hidden @ router_weight^T + router_bias in router_dtype (or the given ones)."""
    if router_dtype is not None:
        router_weight = router_weight.to(router_dtype)
        router_bias = router_bias.to(router_dtype) if router_bias is not None else None
        hidden = hidden.to(router_dtype) if logits is None else hidden
    if logits is None:
        logits = F.linear(hidden, router_weight, router_bias)
    return hidden, router_weight, logits


def route(hidden, router_weight, router_bias, score_correction_bias, top_k: int, scoring: str, norm_topk_prob: bool,
          n_group: int, topk_group: int, routed_scaling_factor: float, router_dtype, weights_dtype=None):
    """The router of the module docstring: returns (logits [T, E], topk_ids [T, k], topk_weights [T, k]). On CUDA
    the selection from the logits is one registered kernel where it takes them (the fused forward's: ties and
    roundings as there)."""
    logits = _router_logits_kernel(hidden, router_weight, router_bias, router_dtype)
    if logits is None:
        logits = _router_linear(hidden, router_weight, router_bias, router_dtype)[2]
    kernel = dispatch.row_kernel("moe_route_select", logits.device)
    if kernel is not None:
        picked = kernel(logits, score_correction_bias, top_k, scoring, norm_topk_prob, n_group, topk_group,
                        routed_scaling_factor, _SIGMOID_NORM_EPS if scoring == "sigmoid" else 0.0, weights_dtype)
        if picked is not None:
            return (logits, *picked)
    logits, ids, weights, _ = _route_forward(hidden, router_weight, router_bias, score_correction_bias, top_k, scoring,
                                             norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype,
                                             logits=logits, weights_dtype=weights_dtype)
    return logits, ids, weights


def _router_logits_kernel(hidden, router_weight, router_bias, router_dtype):
    """An fp32 router's logits on bf16 hidden states (DeepSeek-V3's) by the registered CUDA kernel, which needs no
    fp32 copy of hidden and runs on the tensor cores (torch's fp32 GEMM does not); None: torch's F.linear runs."""
    if router_dtype != torch.float32 or hidden.dtype != torch.bfloat16:
        return None
    kernel = dispatch.row_kernel("moe_router_logits", hidden.device)
    return kernel(hidden, router_weight, router_bias) if kernel is not None else None


def route_backward(d_weights, d_logits_out, routed, router_weight, router_bias, scoring, routed_scaling_factor,
                   d_hidden=None):
    """Gradients of the router, given `routed` = _route_forward(...) of the same inputs: d_weights [T, k] (of its
    weights output) and d_logits_out [T, E] (of its logits output, or None) -> (d_hidden fp32, d_router_weight,
    d_router_bias or None). The routing choices (top-k ids, score_correction_bias) get no gradient. d_hidden (fp32
    [T, H]) given: the router's part is added into it in place (the same sum, without an fp32 temporary)."""
    d_logits = _router_d_logits(d_weights, d_logits_out, routed, scoring, routed_scaling_factor)
    st = routed[3]
    part = fp32_mm(d_logits, st["router_weight"], b_exact=st["weight_exact"], rounded_to=st["hidden_dtype"])
    d_hidden = part.float() if d_hidden is None else d_hidden.add_(part)
    return (d_hidden, *_router_param_grads(d_logits, st["hidden"], router_weight, router_bias,
                                           hidden_exact=st["hidden_exact"]))


def _router_d_logits(d_weights, d_logits_out, routed, scoring, routed_scaling_factor):
    """The router's logits gradient [T, E] in the logits dtype (route_backward's first step): by the registered row
    kernel where `routed` came from the weights' kernel and it takes the gradients, else torch's ops (on scores
    recomputed by them if the state keeps none)."""
    logits, ids, _, st = routed
    if st["scores"] is None:
        kept = st["kept"]
        kernel = dispatch.row_kernel("moe_router_d_logits", logits.device)
        d_logits = kernel(logits, ids, d_weights, d_logits_out, scoring, kept["norm_topk_prob"], routed_scaling_factor,
                          kept["eps"]) if kernel is not None else None
        if d_logits is not None:
            return d_logits
        # the scores' state only (hidden is not needed: the logits are given)
        logits, ids, _, st = _route_forward(logits, st["router_weight"], None, None, kept["top_k"], scoring,
                                            kept["norm_topk_prob"], 1, 1, routed_scaling_factor, None, ids=ids,
                                            logits=logits, kernels=False)
    scores = st["scores"]
    d = d_weights.to(scores.dtype)
    if st["scaled"]:
        d = d * routed_scaling_factor
    if st["denominator"] is not None:  # w = raw / (sum(raw) + eps)
        d = (d - (d * st["normed"]).sum(dim=-1, keepdim=True)) / st["denominator"]
    d_scores = torch.zeros_like(scores).scatter_(1, ids, d)  # top-k ids of a row are distinct
    if scoring == "softmax":
        d_logits = scores * (d_scores - (d_scores * scores).sum(dim=-1, keepdim=True))
    else:
        d_logits = d_scores * scores * (1 - scores)
    d_logits = d_logits.float()
    if d_logits_out is not None:
        d_logits = d_logits + d_logits_out.float()
    return d_logits.to(logits.dtype)


def _router_param_grads(d_logits, hidden, router_weight, router_bias, need_weight: bool = True,
                        need_bias: bool = True, hidden_exact: bool = False):
    """(d_router_weight, d_router_bias) from the logits gradient and the router's input (cast as it ran, or in bf16
    where split_mm takes it: hidden_exact says its values are bf16's); None for a gradient not needed (a frozen
    parameter) and for d_router_bias without a router bias."""
    d_router_weight = None
    if need_weight:
        d_router_weight = fp32_mm(d_logits.transpose(0, 1), hidden, b_exact=hidden_exact,
                                  rounded_to=router_weight.dtype).to(router_weight.dtype)
    d_router_bias = (d_logits.float().sum(0).to(router_bias.dtype)
                     if router_bias is not None and need_bias else None)
    return d_router_weight, d_router_bias


# ----------------------------------------------------------------------------------- grouped matmuls

_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _cuda_grouped_arch(device_index: int) -> bool:
    """torch._grouped_mm's CUTLASS kernel (bf16) exists for sm90 and sm100; other GPUs get torch's fallback."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _tma_layout(t: torch.Tensor) -> bool:
    """The layout torch._grouped_mm accepts: unit stride in one of the last two dims, every other stride a
    multiple of 16 bytes (and, on CUDA, a 16-byte aligned pointer)."""
    align = 16 // t.element_size()
    strides = t.stride()
    if 1 not in strides[-2:] or any(s % align for s in strides if s != 1):
        return False
    return t.device.type != "cuda" or t.data_ptr() % 16 == 0


def _grouped_kernel(a: torch.Tensor, b: torch.Tensor, num_groups: int) -> bool:
    """Whether torch._grouped_mm(a, b, offs) runs as one grouped kernel with no host sync: CUDA bf16 on sm90/sm100
    (at most 1023 groups), CPU fp32/bf16/fp16 (torch loops over the groups in C++, where a sync costs nothing).
    Other CUDA dtypes and GPUs would take torch's own fallback, which syncs on every call: we loop instead. So do
    operands that autograd records (the reference math differentiated by torch.autograd, as tests use it):
    torch._grouped_mm's backward leaves the gradient rows past the last group unwritten."""
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or a.device != b.device:
        return False
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return False
    if a.device.type == "cuda":
        ok = a.dtype == torch.bfloat16 and num_groups < 1024 and _cuda_grouped_arch(a.device.index or 0)
    else:
        ok = a.device.type == "cpu" and a.dtype in _GROUPED_CPU_DTYPES
    return ok and _tma_layout(a) and _tma_layout(b)


class _Groups:
    """Consecutive row groups, one per expert: `ends` [E] int32 on the device (torch._grouped_mm's offs); `sizes`
    the host list if known. `padded`: each group starts with a zero pad row, so none is empty."""

    def __init__(self, ends: torch.Tensor, sizes: Optional[list] = None, padded: bool = False):
        self.ends, self._sizes, self.padded = ends, sizes, padded

    def __len__(self) -> int:
        return self.ends.shape[0]

    def sizes(self) -> list:
        """Host group sizes, for the per-group loop: one host sync per op call where they are not known."""
        if self._sizes is None:
            runtime.refuse_host_read_in_capture(
                self.ends.device, "the MoE reference's per-expert matmul loop (taken for dtypes other than bf16 on "
                "sm90 / sm100, and for operands autograd records; the fused backward, KOSMOS_FUSED_MOE=1, has none)")
            self._sizes = torch.diff(self.ends, prepend=self.ends.new_zeros(1)).tolist()
        return self._sizes


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, groups: _Groups) -> torch.Tensor:
    """Ragged-M grouped matmul [S, N]: group e's rows of a [S, K] times b[e] [K, N]. Rows past the last group are
    left unwritten: the caller must keep them out of its results."""
    if a.stride(-1) == 1 and _grouped_kernel(a, b, len(groups)):  # CUTLASS wants a row-major ragged operand
        kernel = dispatch.row_kernel("moe_grouped_mm", a.device)
        out = kernel(a, b, groups.ends) if kernel is not None else None
        return out if out is not None else torch._grouped_mm(a, b, groups.ends)
    out = a.new_empty(a.shape[0], b.shape[-1])
    start = 0
    for e, n in enumerate(groups.sizes()):
        if n:
            out[start : start + n] = a[start : start + n] @ b[e]
        start += n
    return out


def _grouped_wgrad(a: torch.Tensor, b: torch.Tensor, groups: _Groups, like: torch.Tensor) -> torch.Tensor:
    """Per-expert weight gradient [E, M, N] with the strides of `like`: [e] = a_e^T @ b_e over group e's rows of
    the row-major a [S, M] and b [S, N] (a ragged-K grouped matmul); exact zeros for experts without rows."""
    if like.stride(-2) == 1 and like.stride(-1) != 1:  # column-major weights (HF's is_transposed): the transposes
        return _grouped_wgrad(b, a, groups, like.transpose(-2, -1)).transpose(-2, -1)
    if a.stride(-1) == 1 and b.stride(-1) == 1 and _grouped_kernel(a.t(), b, len(groups)):
        kernel = dispatch.row_kernel("moe_grouped_wgrad", a.device)
        out = kernel(a, b, groups.ends) if kernel is not None else None  # kosmos's writes an empty group's zeros
        if out is None:
            out = torch._grouped_mm(a.t(), b, groups.ends)  # a^T column-major: the layout that allows empty groups
            if not groups.padded:  # never trust what a kernel leaves for an empty group
                for e in [e for e, n in enumerate(groups.sizes()) if n == 0]:
                    out[e].zero_()
    else:
        out = a.new_zeros(len(groups), a.shape[1], b.shape[1])
        start = 0
        for e, n in enumerate(groups.sizes()):
            if n:
                out[e] = a[start : start + n].t() @ b[start : start + n]
            start += n
    return out if out.stride() == like.stride() else torch.empty_like(like).copy_(out)


# ------------------------------------------------------------------------------------------- experts


class _SortedPairs:
    """The rows the reference experts compute: the (token, slot) pairs sorted by expert, each expert's group led by
    one zero pad row. So no group is empty (the weight gradients need no masking) and a sentinel pair (id E, sorted
    past the last group, its rows never written) reads a pad row, whose outputs and gradients are exactly 0.
    Found on the device: `token` [S + E] of each row (T for a pad), `pair` [S + E] (flat pair index, S for a pad),
    `row` [S] of each pair (pad row 0 for a sentinel), `pads` [E] the pad rows, `counts` [E] pairs per expert,
    `groups` the padded row groups; `gather` puts a tensor's rows in this order."""

    def __init__(self, topk_ids: torch.Tensor, num_experts: int):
        kernel = dispatch.row_kernel("moe_sorted_pairs", topk_ids.device)
        if kernel is not None:  # the same tensors in four launches (the torch math below is about twenty)
            self.counts, self.token, self.pair, self.row, self.pads, ends = kernel(topk_ids.contiguous(), num_experts)
            self.groups = _Groups(ends, padded=True)
            return
        flat = topk_ids.reshape(-1).long()
        pairs, device = flat.numel(), flat.device
        sorted_ids, perm = torch.sort(flat, stable=True)  # tokens ascending inside an expert: the fused layout
        experts = torch.arange(num_experts, device=device)
        ends = torch.searchsorted(sorted_ids, experts, right=True)  # without the pad rows
        self.counts = torch.diff(ends, prepend=ends.new_zeros(1))
        # sorted pair i of expert e: row i + e + 1, past the pads of experts 0..e; a sentinel's: i + E
        at = torch.arange(pairs, device=device) + sorted_ids.clamp(max=num_experts - 1) + 1
        self.pair = torch.full((pairs + num_experts,), pairs, dtype=torch.long, device=device)
        self.pair[at] = perm
        self.token = self.pair // topk_ids.shape[1]
        self.row = torch.empty_like(perm)
        self.row[perm] = at
        self.row = torch.where(flat < num_experts, self.row, 0)
        self.pads = ends - self.counts + experts
        self.groups = _Groups((ends + experts + 1).to(torch.int32), padded=True)

    def gather(self, t: torch.Tensor, index: Optional[torch.Tensor] = None,
               dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """t's rows (elements) at `index` (default `token`; `pair` for per-pair tensors) in `dtype` (default t's),
        the pad rows zero: one gather, no copy of t with a zero row appended."""
        index = self.token if index is None else index
        kernel = dispatch.row_kernel("moe_gather_rows", t.device)
        if kernel is not None and t.is_contiguous():
            return kernel(t, index, dtype)
        t = t.to(dtype or t.dtype)  # before the gather: the smaller tensor
        if t.shape[0] == 0:
            return t.new_zeros(index.shape[0], *t.shape[1:])
        return t.index_select(0, index.clamp(max=t.shape[0] - 1)).index_fill_(0, self.pads, 0)


def _swiglu(h, down_dtype):
    """SwiGLU of up-projected rows h = [gate | up]: (gate, up, silu(gate), act = silu(gate) * up in down_dtype)."""
    gate, up = h.chunk(2, dim=-1)
    silu = F.silu(gate)
    return gate, up, silu, (silu * up).to(down_dtype)


def _act(h, down_dtype):
    """`_swiglu`'s act alone, by the registered row kernel on CUDA (one pass over h; torch's silu and mul make two)."""
    kernel = dispatch.row_kernel("moe_swiglu_rows", h.device)
    if kernel is not None and h.is_contiguous():
        return kernel(h, down_dtype)
    return _swiglu(h, down_dtype)[3]


def _experts_up(x, gate_up_proj, groups, down_dtype):
    """Up projection and SwiGLU of the grouped rows x (as `_swiglu`)."""
    return _swiglu(_grouped_mm(x, gate_up_proj.transpose(1, 2), groups), down_dtype)


def _experts_up_act(x, gate_up_proj, groups, down_dtype):
    """(up rows h = [gate | up], act in down_dtype) of the grouped rows x: by the registered CUDA kernel that makes
    both in one launch (a grouped GEMM with a SwiGLU epilogue) where it takes them, else the grouped matmul and
    `_act`; the same bits either way."""
    b = gate_up_proj.transpose(1, 2)
    if x.stride(-1) == 1 and _grouped_kernel(x, b, len(groups)):
        kernel = dispatch.row_kernel("moe_grouped_mm_swiglu", x.device)
        both = kernel(x, b, groups.ends, down_dtype) if kernel is not None else None
        if both is not None:
            return both
    up = _grouped_mm(x, b, groups)
    return up, _act(up, down_dtype)


def _experts_up_act_gathered(hidden, rows, gate_up_proj, down_dtype):
    """_experts_up_act of rows.gather(hidden) by the registered CUDA kernel that gathers the rows inside the up
    projection's launch (the gathered copy is never written), or None where none is registered, it declines, or the
    gather would cast (hidden not in the weights' dtype): the caller gathers."""
    if hidden.dtype != gate_up_proj.dtype or not hidden.is_contiguous():
        return None
    kernel = dispatch.row_kernel("moe_grouped_mm_swiglu_gathered", hidden.device)
    b = gate_up_proj.transpose(1, 2)
    if kernel is None or not _grouped_kernel(hidden, b, len(rows.groups)):
        return None
    return kernel(hidden, rows.token, b, rows.groups.ends, down_dtype)


def _swiglu_backward(gate, up, silu, d_act):
    """d[gate | up] of act = silu(gate) * up, given d_act (in silu's dtype)."""
    sig = torch.sigmoid(gate)
    d_gate = d_act * up * (sig * (1 + gate * (1 - sig)))
    return torch.cat([d_gate, d_act * silu], dim=-1)


def _experts_grads(x, d_y, gate_up_proj, down_proj, groups, wgrads=(True, True)):
    """Backward of the experts on rows grouped by expert: x [S, H] in gate_up_proj's dtype and d_y [S, H] (gradient
    of each row's expert output, in down_proj's dtype) -> (y [S, H] recomputed, d_x [S, H] in gate_up_proj's dtype,
    d_gate_up_proj, d_down_proj). Rows past the last group get unwritten y and d_x. wgrads: whether d_gate_up_proj
    / d_down_proj are wanted (None and no grouped matmul for a frozen weight)."""
    gate, up, silu, act = _experts_up(x, gate_up_proj, groups, down_proj.dtype)
    y = _grouped_mm(act, down_proj.transpose(1, 2), groups)
    d_down = _grouped_wgrad(d_y, act, groups, down_proj) if wgrads[1] else None
    d_act = _grouped_mm(d_y, down_proj, groups).to(silu.dtype)
    d_h = _swiglu_backward(gate, up, silu, d_act)
    d_gate_up = _grouped_wgrad(d_h, x, groups, gate_up_proj) if wgrads[0] else None
    return y, _grouped_mm(d_h, gate_up_proj, groups), d_gate_up, d_down


def _rowdot(a: torch.Tensor, b: torch.Tensor, chunk: int = 1 << 14) -> torch.Tensor:
    """fp32 sum over the last dim of a * b (products in fp32), in row chunks to bound the fp32 temporaries."""
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    for r in range(0, a.shape[0], chunk):
        out[r : r + chunk] = (a[r : r + chunk].float() * b[r : r + chunk].float()).sum(dim=-1)
    return out


def _swiglu_rows_backward_(h, d_au, w):
    """(d_h [S, 2I] of h's dtype, written over h, d_w [S] fp32, act * w [S, I] written over d_au) for
    act = silu(gate) * up of h: d_au [S, I] is grad_out rows @ down_proj[e] without the routing weights w [S], so
    d_act = d_au * w and d_w = <d_au, act>; act * w (in d_au's dtype, each product in promote(d_au, w)) is
    d_down_proj's operand."""
    kernel = dispatch.row_kernel("moe_swiglu_rows_backward", h.device)
    if kernel is not None:
        d_h, d_w = kernel(h, d_au, w, in_place=True, act_w=d_au)
        return d_h, d_w, d_au
    gate, up, silu, act = _swiglu(h, d_au.dtype)
    act_w = (act.to(torch.promote_types(d_au.dtype, w.dtype)) * w.unsqueeze(-1)).to(d_au.dtype)
    d_act = (d_au * w.unsqueeze(-1)).to(silu.dtype)
    d_w = _rowdot(d_au, act)
    return h.copy_(_swiglu_backward(gate, up, silu, d_act)), d_w, d_au.copy_(act_w)


def _experts_backward_saved_(grad_out, hidden, rows, w_rows, h, gate_up_proj, down_proj, wgrads=(True, True)):
    """The experts' backward with the forward's up rows h = [gate | up] saved: no up projection and no y
    recomputed; h is overwritten (with d_h). w_rows [S]: each row's routing weight. d_down_proj = sum g^T (act * w)
    with g the rows' grad_out; the weight's gradient <g, y> is <g @ down_e, act>, so one grouped matmul gives it
    and d_act, and one pass over the rows gives d_h, the weights' gradients and act * w (over g @ down_e). Peak
    memory: temporaries are dropped after their last use and d_h takes h's storage, so the weight grads are
    computed beside d_h and one [S, H] buffer at a time and no more. -> (d_h [S, 2I] in h's storage, d_weight of
    each row fp32 [S], d_gate_up_proj, d_down_proj); d_x = d_h @ gate_up_proj per group is left to the caller
    (anything small it computes before d_x stays off the peak). wgrads: whether d_gate_up_proj / d_down_proj are
    wanted; a frozen weight's is None, its grouped matmul (and for gate_up_proj the gather of x) not run."""
    g = rows.gather(grad_out, dtype=down_proj.dtype)
    d_au = _grouped_mm(g, down_proj, rows.groups)
    d_h, d_w_rows, act_w = _swiglu_rows_backward_(h, d_au, w_rows)
    del d_au
    d_down = _grouped_wgrad(g, act_w, rows.groups, down_proj) if wgrads[1] else None
    del g, act_w
    d_gate_up = None
    if wgrads[0]:
        x = rows.gather(hidden, dtype=gate_up_proj.dtype)
        d_gate_up = _grouped_wgrad(d_h, x, rows.groups, gate_up_proj)
    return d_h, d_w_rows, d_gate_up, d_down


def _fold_saved(d_x, row, num_tokens, top_k, h, d_logits=None, router_weight=None, weight_exact=False,
                hidden_dtype=None):
    """d_hidden fp32 [T, H]: the rows d_x folded (`_fold`), plus the router's part d_logits @ router_weight (in the
    logits dtype, added in fp32 to each token's sum: what route_backward's in-place add computes) if d_logits is
    given. Both go into the storage of h (the saved up rows, dead once d_x is made) where they fit. hidden_dtype:
    what the caller rounds d_hidden to (split_mm's condition)."""
    shape = (num_tokens, d_x.shape[1])
    out = _storage_as(h, shape, torch.float32)
    part = None
    if d_logits is not None:
        scratch = spare = None
        if out is not None:
            scratch = _storage_as(h, shape, d_logits.dtype, offset=math.prod(shape) * 4)
            end = math.prod(shape) * (4 + d_logits.dtype.itemsize)
            free = h.numel() * h.element_size() - end
            spare = _storage_as(h, (free,), torch.uint8, offset=end) if scratch is not None and free > 0 else None
        part = fp32_mm(d_logits, router_weight, b_exact=weight_exact, out=scratch, rounded_to=hidden_dtype,
                       workspace=spare)
    return _fold(d_x, row, num_tokens, top_k, torch.float32, out=out, add=part)


def _fold(rows, row, num_tokens, top_k, dtype=None, out=None, add=None):
    """[T, H]: the pair rows rows[row[t * k + j]] summed over the slots j in order (in `dtype` if given), one
    slot at a time (no [T, k, H] temporary), then + add [T, H] if given; written into `out` (contiguous, of that
    dtype) if given."""
    row = row.view(num_tokens, top_k)
    kernel = dispatch.row_kernel("moe_fold", rows.device)
    if kernel is not None and dtype == torch.float32 and rows.is_contiguous():
        return kernel(rows, row, out=out, add=add)
    acc = rows[row[:, 0]].to(dtype or rows.dtype)
    for j in range(1, top_k):
        acc += rows[row[:, j]]
    if add is not None:
        acc += add
    return acc if out is None else out.copy_(acc)


def _storage_as(t: torch.Tensor, shape, dtype, offset: int = 0) -> Optional[torch.Tensor]:
    """A contiguous tensor of `shape` and `dtype` over t's storage from byte `offset` of t on (t contiguous), or None
    if t is too small: a scratch buffer in memory that t no longer needs."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not t.is_contiguous() or t.numel() * t.element_size() < offset + nbytes or (t.data_ptr() + offset) % 16:
        return None
    return t.view(-1).view(torch.uint8)[offset : offset + nbytes].view(dtype).view(shape)


def experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation: str = "silu",
            return_up: bool = False):
    """The experts of the module docstring (HF's grouped_mm experts: one grouped matmul per projection over the
    pairs sorted by expert); returns (out [T, H], tokens_per_expert [E] int32) (+ the saved up rows of the module
    docstring with return_up). A pair whose id is E (the sentinel) is not computed: it adds 0."""
    num_tokens, top_k = topk_ids.shape
    rows = _SortedPairs(topk_ids, gate_up_proj.shape[0])
    up_act = _experts_up_act_gathered(hidden, rows, gate_up_proj, down_proj.dtype)
    if up_act is None:
        x = rows.gather(hidden, dtype=gate_up_proj.dtype)
        up_act = _experts_up_act(x, gate_up_proj, rows.groups, down_proj.dtype)
    up, act = up_act
    y = _grouped_mm(act, down_proj.transpose(1, 2), rows.groups)
    res = (_fold_weighted(y, rows.row, topk_weights, hidden.dtype), rows.counts.to(torch.int32))
    return res + (up,) if return_up else res


def _fold_weighted(y, row, topk_weights, dtype):
    """[T, H] in dtype: sum over the slots j of y[row[t * k + j]] * topk_weights[t, j], each product in the promoted
    dtype, summed in fp32 one slot at a time, rounded once to the promoted dtype, then cast to dtype (no [T, k, H]
    temporary; the row kernel casts in the same pass)."""
    num_tokens, top_k = topk_weights.shape
    row = row.view(num_tokens, top_k)
    kernel = dispatch.row_kernel("moe_fold", y.device)
    if kernel is not None and y.is_contiguous():
        return kernel(y, row, topk_weights.contiguous(), dtype=dtype)
    acc = (y[row[:, 0]] * topk_weights[:, :1]).float()
    for j in range(1, top_k):
        acc += y[row[:, j]] * topk_weights[:, j : j + 1]
    return acc.to(torch.promote_types(y.dtype, topk_weights.dtype)).to(dtype)


def experts_backward_saved_rows(grad_out, hidden, rows, topk_weights, gate_up_proj, down_proj, saved_up,
                                wgrads=(True, True)):
    """`experts_backward` with saved up rows up to the rows' d_up: (d_h [S, 2I] written over saved_up,
    d_topk_weights, d_gate_up_proj, d_down_proj). The rows' d_x is _grouped_mm(d_h, gate_up_proj, rows.groups),
    after which saved_up's storage is dead (`_fold_saved` folds d_x into it)."""
    num_tokens, top_k = topk_weights.shape
    w_rows = rows.gather(topk_weights.reshape(-1), rows.pair)
    d_h, d_w_rows, d_gate_up, d_down = _experts_backward_saved_(grad_out, hidden, rows, w_rows, saved_up,
                                                                gate_up_proj, down_proj, wgrads)
    kernel = dispatch.row_kernel("moe_gather_rows", d_w_rows.device)
    if kernel is not None and d_w_rows.is_contiguous():  # the index and the cast in one launch
        d_weights = kernel(d_w_rows, rows.row, topk_weights.dtype)
    else:
        d_weights = d_w_rows[rows.row].to(topk_weights.dtype)
    return d_h, d_weights.view(num_tokens, top_k), d_gate_up, d_down


def experts_backward(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation: str = "silu",
                     saved_up: Optional[torch.Tensor] = None, wgrads=(True, True)):
    """Gradients of `experts` -> (d_hidden fp32 [T, H], d_topk_weights, d_gate_up_proj, d_down_proj).
    Recomputes the up projection unless the forward's saved up rows are given (then they are overwritten: their
    storage holds d_up); matmuls run in the weights' dtype, sums accumulate in fp32. Sentinel pairs (id E) get zero
    gradients. wgrads: whether d_gate_up_proj / d_down_proj are wanted (None for a frozen weight)."""
    num_tokens, top_k = topk_ids.shape
    rows = _SortedPairs(topk_ids, gate_up_proj.shape[0])
    if saved_up is not None:
        d_h, d_weights, d_gate_up, d_down = experts_backward_saved_rows(grad_out, hidden, rows, topk_weights,
                                                                        gate_up_proj, down_proj, saved_up, wgrads)
        d_x = _grouped_mm(d_h, gate_up_proj, rows.groups)
        del d_h
        return _fold_saved(d_x, rows.row, num_tokens, top_k, saved_up), d_weights, d_gate_up, d_down
    w_rows = rows.gather(topk_weights.reshape(-1), rows.pair)
    x = rows.gather(hidden, dtype=gate_up_proj.dtype)
    product_dtype = torch.promote_types(down_proj.dtype, topk_weights.dtype)
    g = grad_out.to(product_dtype)  # d(weighted pair): the fold sums the pairs of a token
    d_y = (rows.gather(g) * w_rows.unsqueeze(-1)).to(down_proj.dtype)
    y, d_x, d_gate_up, d_down = _experts_grads(x, d_y, gate_up_proj, down_proj, rows.groups, wgrads)
    y_pairs = y[rows.row].view(num_tokens, top_k, y.shape[-1]).to(product_dtype)
    d_weights = (g.unsqueeze(1) * y_pairs).float().sum(dim=-1).to(topk_weights.dtype)
    return _fold(d_x, rows.row, num_tokens, top_k, torch.float32), d_weights, d_gate_up, d_down


# ------------------------------------------------------------------------------- expert parallelism


def _all_to_all(x: torch.Tensor, out_splits: list, in_splits: list, group_name: str) -> torch.Tensor:
    fc = torch.ops._c10d_functional
    return fc.wait_tensor(fc.all_to_all_single(x.contiguous(), out_splits, in_splits, group_name))


def _all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    fc = torch.ops._c10d_functional
    return fc.wait_tensor(fc.all_reduce(x.contiguous(), "sum", group_name))


class _EpPlan:
    """Where the routed (token, slot) pairs of this rank go, and what this rank's experts receive.

    Home side: `perm` sorts the pairs by global expert id (hence by owner rank), `row` is each pair's place in that
    order, `token` each sorted pair's token, `send_splits[d]` how many sorted pairs go to rank d. Expert side:
    `recv_splits[s]` rows arrive from rank s (grouped by local expert inside each source); `order` lists the
    received rows expert-major (expert 0's rows from ranks 0, 1, ..., then expert 1's, ...), `local_counts[j]` how
    many rows local expert j gets, `groups` the same as the local experts' row groups."""

    def __init__(self, topk_ids: torch.Tensor, num_local: int, group_name: str, ep_world_size: int):
        # before bincount, whose output size is read on the host too
        runtime.refuse_host_read_in_capture(topk_ids.device, "the expert-parallel reference impl's split sizes")
        num_experts = num_local * ep_world_size
        expert_ids = topk_ids.reshape(-1).long()
        _, self.perm = torch.sort(expert_ids, stable=True)
        self.token = self.perm // topk_ids.shape[1]
        self.row = torch.empty_like(self.perm)
        self.row[self.perm] = torch.arange(self.perm.numel(), device=self.perm.device)
        self.counts = torch.bincount(expert_ids, minlength=num_experts)  # [E], this rank's pairs
        # recv[s, j]: pairs rank s sends to my local expert j (an all_to_all of the [ep, E_loc] count matrix)
        recv_counts = _all_to_all(self.counts, [num_local] * ep_world_size, [num_local] * ep_world_size, group_name)
        recv_counts = recv_counts.view(ep_world_size, num_local)
        # the reference path's one host sync: all_to_all_single takes host split sizes
        send = self.counts.view(ep_world_size, num_local).sum(1).tolist()
        recv = recv_counts.tolist()
        self.send_splits, self.recv_splits = send, [sum(row) for row in recv]
        self.local_counts = [sum(recv[s][j] for s in range(ep_world_size)) for j in range(num_local)]
        self.groups = _Groups(torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32), self.local_counts)
        # local expert of each received row (source-major), stably sorted: expert-major, sources in rank order
        device = topk_ids.device
        row_expert = torch.arange(num_local, device=device).repeat(ep_world_size).repeat_interleave(
            torch.tensor([n for row in recv for n in row], dtype=torch.long, device=device))
        self.order = torch.sort(row_expert, stable=True).indices
        self.group_name, self.ep_world_size = group_name, ep_world_size

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Home rows (sorted-pair order) -> the rows this rank's experts receive, expert-major."""
        return _all_to_all(rows, self.recv_splits, self.send_splits, self.group_name)[self.order]

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Expert-major rows computed here -> their home ranks, in the home's sorted-pair order."""
        received = torch.empty_like(rows)
        received[self.order] = rows
        return _all_to_all(received, self.send_splits, self.recv_splits, self.group_name)

    def global_counts(self) -> torch.Tensor:
        return _all_reduce_sum(self.counts, self.group_name).to(torch.int32)


def ep_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation: str, group_name: str,
               ep_world_size: int):
    """`experts` with the experts spread over the EP group (module docstring): gate_up_proj / down_proj are this
    rank's E_loc experts, topk_ids global; returns (out [T, H] of this rank's tokens, global tokens_per_expert)."""
    num_tokens, top_k = topk_ids.shape
    plan = _EpPlan(topk_ids, gate_up_proj.shape[0], group_name, ep_world_size)
    x = plan.dispatch(hidden[plan.token].to(gate_up_proj.dtype))
    act = _act(_grouped_mm(x, gate_up_proj.transpose(1, 2), plan.groups), down_proj.dtype)
    y_home = plan.combine(_grouped_mm(act, down_proj.transpose(1, 2), plan.groups))  # [T * k, H], sorted-pair order
    return _fold_weighted(y_home, plan.row, topk_weights, hidden.dtype), plan.global_counts()


def ep_experts_backward(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation: str,
                        group_name: str, ep_world_size: int):
    """Gradients of `ep_experts` -> (d_hidden fp32 [T, H], d_topk_weights [T, k], d_gate_up_proj, d_down_proj of
    the local experts). Home: d_y = grad_out[token] * weight rows go to the experts with the token rows; the
    experts recompute y and send back y (for d_topk_weights, computed at home) and d_x (folded into d_hidden)."""
    num_tokens, top_k = topk_ids.shape
    plan = _EpPlan(topk_ids, gate_up_proj.shape[0], group_name, ep_world_size)
    product_dtype = torch.promote_types(down_proj.dtype, topk_weights.dtype)
    w_sorted = topk_weights.reshape(-1)[plan.perm]
    g_sorted = grad_out.to(product_dtype)[plan.token]
    x = plan.dispatch(hidden[plan.token].to(gate_up_proj.dtype))
    d_y = plan.dispatch((g_sorted * w_sorted.unsqueeze(-1)).to(down_proj.dtype))
    y, d_x, d_gate_up, d_down = _experts_grads(x, d_y, gate_up_proj, down_proj, plan.groups)
    y_home, d_x_home = plan.combine(y), plan.combine(d_x)
    d_w_sorted = (g_sorted * y_home.to(product_dtype)).float().sum(dim=-1)
    d_weights = d_w_sorted[plan.row].view(topk_ids.shape).to(topk_weights.dtype)
    return _fold(d_x_home, plan.row, num_tokens, top_k, torch.float32), d_weights, d_gate_up, d_down


def _experts_any(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name, ep_world_size):
    if ep_group_name is None:
        return experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation)
    return ep_experts(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, ep_group_name,
                      ep_world_size)


def _experts_backward_any(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation,
                          ep_group_name, ep_world_size, wgrads=(True, True)):
    """wgrads skips frozen weights' gradients without EP; the EP backward computes both (its callers drop them)."""
    if ep_group_name is None:
        return experts_backward(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation,
                                wgrads=wgrads)
    return ep_experts_backward(grad_out, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation,
                               ep_group_name, ep_world_size)


def _own_pairs(topk_ids: torch.Tensor, num_local: int, group_name: str) -> torch.Tensor:
    """ep_mode="all_reduce": global ids -> local ids of this rank's experts, the sentinel num_local elsewhere."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    rank = _resolve_process_group(group_name).rank()
    mine = torch.div(topk_ids, num_local, rounding_mode="floor") == rank
    return torch.where(mine, topk_ids % num_local, torch.full_like(topk_ids, num_local))


def _replicated_forward(hidden, ids, weights, gate_up_proj, down_proj, activation, group_name):
    """ep_mode="all_reduce" experts: this rank's share of every token's output, summed over the group."""
    partial, _ = experts(hidden, _own_pairs(ids, gate_up_proj.shape[0], group_name), weights, gate_up_proj,
                         down_proj, activation)
    num_experts = gate_up_proj.shape[0] * torch.distributed.distributed_c10d._resolve_process_group(group_name).size()
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).to(torch.int32)
    return _all_reduce_sum(partial, group_name), counts


def _replicated_backward(grad_out, hidden, ids, weights, gate_up_proj, down_proj, activation, group_name):
    """Gradients of `_replicated_forward`: (d_hidden of the experts fp32, d_topk_weights, local expert grads);
    d_hidden and d_topk_weights are summed over the group (one all_reduce)."""
    d_x, d_w, d_gate_up, d_down = experts_backward(grad_out, hidden, _own_pairs(ids, gate_up_proj.shape[0], group_name),
                                                   weights, gate_up_proj, down_proj, activation)
    both = _all_reduce_sum(torch.cat([d_x, d_w.float()], dim=1), group_name)
    return both[:, : d_x.shape[1]], both[:, d_x.shape[1] :].to(d_w.dtype), d_gate_up, d_down
