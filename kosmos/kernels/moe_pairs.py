"""The MoE backward's sorted (token, slot) pairs (kosmos.ops.moe_math `_SortedPairs`) by a counting sort on the device:
four small Triton launches where the torch math takes about twenty ops, a sort among them. A small layer's backward
is bound by the host's launches (benchmarks/RESULTS.md, fourteenth and fifteenth sessions), so fewer launches is the
point; the result is the torch math's, index for index. Registered with kosmos.ops.dispatch as a row kernel.

    sorted_pairs(topk_ids [T, k] int, num_experts E) -> (counts [E], token [S + E], pair [S + E], row [S], pads [E],
        ends [E] int32), S = T * k, all int64 but ends; the layout of `_SortedPairs`: the pairs sorted stably by
        expert, each expert's group led by one pad row (pair S, token T); a pair whose id is not in [0, E) (the
        sentinel E) sorts past the last group and gets row 0.

Chunks of C pairs: (1) each chunk counts its pairs per expert, (2) a scan over the chunks gives each chunk's first
row per expert and each expert's total, (3) one program turns the totals into group starts, (4) each pair's row is
its group's start + its chunk's offset + the pairs of its expert before it in the chunk. No atomics: the same rows on
every run."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kosmos.kernels import launch_plan, runtime

C = 128  # pairs per chunk: the in-chunk rank compares C x C ids
BB = 64  # experts per step of the counts and of the scan
CB = 32  # chunks per step of the scan


@triton.jit
def _expert_of(ids, p, pm, E):
    """The expert id of pairs p (E for the sentinel and any id outside [0, E))."""
    e = tl.load(ids + p, mask=pm, other=0)  # compared before any cast: an int64 id past int32 is no expert either
    return tl.where((e >= 0) & (e < E), e, E).to(tl.int32)


@triton.jit
def _chunk_counts_kernel(ids, hist, S, E, C: tl.constexpr, BB: tl.constexpr):
    c = tl.program_id(0)
    p = c * C + tl.arange(0, C)
    pm = p < S
    e = tl.where(pm, _expert_of(ids, p, pm, E), -1)
    for b0 in range(0, E + 1, BB):
        b = b0 + tl.arange(0, BB)
        n = tl.sum((e[:, None] == b[None, :]).to(tl.int32), axis=0)
        tl.store(hist + c * (E + 1) + b, n, mask=b <= E)


@triton.jit
def _chunk_offsets_kernel(hist, totals, NC, E, CB: tl.constexpr, BB: tl.constexpr):
    """hist[c, b] (pairs of expert b in chunk c) becomes the pairs of expert b in chunks before c; totals[b] all."""
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    bm = b <= E
    run = tl.zeros((BB,), tl.int32)
    for c0 in range(0, NC, CB):
        c = c0 + tl.arange(0, CB)
        m = (c < NC)[:, None] & bm[None, :]
        at = hist + c[:, None] * (E + 1) + b[None, :]
        n = tl.load(at, mask=m, other=0)
        tl.store(at, tl.cumsum(n, axis=0) - n + run[None, :], mask=m)
        run += tl.sum(n, axis=0)
    tl.store(totals + b, run, mask=bm)


@triton.jit
def _group_starts_kernel(totals, start, counts, pads, ends, pair, token, S, T, E, EB: tl.constexpr):
    b = tl.arange(0, EB)
    n = tl.load(totals + b, mask=b <= E, other=0)
    size = tl.where(b < E, n + 1, 0)  # a group: its pad row, then its pairs
    first = tl.cumsum(size, axis=0) - size  # the sentinel's "group" starts past the last one
    em = b < E
    tl.store(start + b, first + em.to(tl.int32), mask=b <= E)
    tl.store(counts + b, n.to(tl.int64), mask=em)
    tl.store(pads + b, first.to(tl.int64), mask=em)
    tl.store(ends + b, first + size, mask=em)
    tl.store(pair + first, tl.full((EB,), 0, tl.int64) + S, mask=em)
    tl.store(token + first, tl.full((EB,), 0, tl.int64) + T, mask=em)


@triton.jit
def _pair_rows_kernel(ids, hist, start, row, pair, token, S, E, TOP_K, C: tl.constexpr):
    c = tl.program_id(0)
    i = tl.arange(0, C)
    p = c * C + i
    pm = p < S
    e = _expert_of(ids, p, pm, E)
    before = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])  # [C, C]: pair j of the same expert before i
    rank = tl.sum(before.to(tl.int32), axis=1)
    r = tl.load(start + e, mask=pm, other=0) + tl.load(hist + c * (E + 1) + e, mask=pm, other=0) + rank
    p64 = p.to(tl.int64)
    tl.store(row + p, tl.where(e < E, r, 0).to(tl.int64), mask=pm)
    tl.store(pair + r, p64, mask=pm)
    tl.store(token + r, p64 // TOP_K, mask=pm)


def sorted_pairs(topk_ids: torch.Tensor, num_experts: int):
    """(counts, token, pair, row, pads, ends) of the module docstring."""
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or not topk_ids.is_contiguous():
        raise ValueError(f"kosmos moe_pairs: topk_ids must be a contiguous integer [T, k], got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}")
    if not (topk_ids.is_cuda or runtime.interpreting()):
        raise ValueError("kosmos moe_pairs: a CUDA topk_ids expected")
    T, k = topk_ids.shape
    S, E, device = T * k, num_experts, topk_ids.device
    if S + E >= 2**31:
        raise ValueError(f"kosmos moe_pairs: {S} pairs and {E} experts overflow int32 rows")
    nc = triton.cdiv(S, C)
    # the int64 five from one allocation (no slices at these lengths): 9.6 us against 11.2 for five on an H100's host
    # (RESULTS.md, sixty-first session); the int32 four as four, since their carve's split and slices took 14.1 us
    # against 9.1
    token, pair, row, counts, pads = launch_plan.carved(torch.int64, device, S + E, S + E, S, E, E)
    i32 = dict(dtype=torch.int32, device=device)
    ends, totals, start = torch.empty(E, **i32), torch.empty(E + 1, **i32), torch.empty(E + 1, **i32)
    hist = torch.empty(max(nc, 1) * (E + 1), **i32)
    if nc:
        launch_plan.launch(_chunk_counts_kernel, (nc,), (topk_ids, hist, S, E), C=C, BB=BB, num_warps=4)
        launch_plan.launch(_chunk_offsets_kernel, (triton.cdiv(E + 1, BB),), (hist, totals, nc, E), CB=CB, BB=BB,
                           num_warps=4)
    else:
        totals.zero_()
    launch_plan.launch(_group_starts_kernel, (1,), (totals, start, counts, pads, ends, pair, token, S, T, E),
                       EB=triton.next_power_of_2(E + 1), num_warps=4)
    if nc:
        launch_plan.launch(_pair_rows_kernel, (nc,), (topk_ids, hist, start, row, pair, token, S, E, k), C=C,
                           num_warps=4)
    return counts, token, pair, row, pads, ends
