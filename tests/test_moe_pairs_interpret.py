"""kosmos.kernels.moe_pairs (the backward's sorted pairs by a counting sort) on the CPU under TRITON_INTERPRET=1,
index for index against the torch math of kosmos.ops.moe_math._SortedPairs, in subprocesses, one per core
(tests/_interp.py; TRITON_INTERPRET must be set before triton is imported); each test checks its case's line of the
report."""
from __future__ import annotations

import _interp
import torch

# (T, k, E, how the ids are drawn): several chunks of 128 pairs, a last chunk cut short, sentinel ids (E), experts
# without pairs, every pair on one expert, T = 0, more experts than one scan step covers
CASES = {
    "random_three_chunks": (100, 3, 5, "random"),
    "ragged_last_chunk_with_sentinels": (90, 4, 7, "sentinels"),
    "empty_experts": (64, 2, 40, "few"),
    "all_on_one_expert": (70, 2, 6, "one"),
    "no_tokens": (0, 8, 16, "random"),
    "top1_one_token": (1, 1, 3, "random"),
    "many_experts_many_chunks": (300, 8, 130, "random"),
    "int64_id_past_int32_is_no_expert": (50, 2, 6, "huge"),
}


def _ids(T, k, E, how, seed=0):
    g = torch.Generator().manual_seed(seed)
    if how == "one":
        return torch.full((T, k), E // 2, dtype=torch.int32)
    if how == "few":  # experts 3 and 17 only, distinct per token
        return torch.tensor([[3, 17]] * T, dtype=torch.int32)[:, :k]
    scores = torch.rand(T, E, generator=g)
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)  # distinct per token, as a router's
    if how == "sentinels":
        ids[torch.rand(T, k, generator=g) < 0.2] = E
    if how == "huge":  # one int64 id that an int32 cast would turn into expert 3
        ids = ids.long()
        ids[7, 1] = 2**32 + 3
    return ids.contiguous()


def _check_case(T, k, E, how):
    from kosmos.kernels import moe_pairs
    from kosmos.ops import moe_math as ops

    ids = _ids(T, k, E, how)
    want = ops._SortedPairs(ids, E)  # on the CPU: the torch math
    counts, token, pair, row, pads, ends = moe_pairs.sorted_pairs(ids, E)
    got = dict(counts=counts, token=token, pair=pair, row=row, pads=pads, ends=ends)
    expect = dict(counts=want.counts, token=want.token, pair=want.pair, row=want.row, pads=want.pads,
                  ends=want.groups.ends)
    for name, t in got.items():
        w = expect[name]
        assert t.dtype == w.dtype and tuple(t.shape) == tuple(w.shape), (name, t.dtype, w.dtype, t.shape, w.shape)
        assert torch.equal(t, w), f"{name}: {t.tolist()[:40]} vs {w.tolist()[:40]}"
    return {"pairs": T * k, "groups_end": int(ends[-1]) if E else 0}


def _main():
    _interp.run_cases(list(CASES), {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()})


report, test_interpreted_case = _interp.case_tests(__file__, CASES, timeout=300)


def test_torch_math_layout_by_hand():
    """The layout both sides must produce, spelled out for one small routing (the torch math, in-process)."""
    from kosmos.ops import moe_math as ops

    ids = torch.tensor([[1, 0], [1, 3], [0, 1]], dtype=torch.int32)  # E = 3: id 3 is the sentinel
    rows = ops._SortedPairs(ids, 3)
    # rows: 0 pad(e0), 1-2 pairs 1, 4 (e0), 3 pad(e1), 4-6 pairs 0, 2, 5 (e1), 7 pad(e2), 8 the sentinel pair 3
    assert rows.pair.tolist() == [6, 1, 4, 6, 0, 2, 5, 6, 3]
    assert rows.token.tolist() == [3, 0, 2, 3, 0, 1, 2, 3, 1]
    assert rows.row.tolist() == [4, 1, 5, 0, 2, 6]
    assert rows.counts.tolist() == [2, 3, 0] and rows.pads.tolist() == [0, 3, 7]
    assert rows.groups.ends.tolist() == [3, 7, 8]


if __name__ == "__main__":
    _main()
