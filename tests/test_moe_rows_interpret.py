"""kosmos.kernels.moe_rows' forward SwiGLU row kernel and its fold on the CPU under TRITON_INTERPRET=1 against the
torch math of kosmos.ops.moe_math (_swiglu: the reference forward's act; _fold_weighted / _fold: the forward's
weighted fold into hidden's dtype and the backward's fp32 fold plus an add), in subprocesses (tests/_interp.py)."""
from __future__ import annotations

import _interp
import torch

# (S, I, h dtype, act dtype): rows and columns past one block each and cut short, one row, fp32, act in another
# dtype. No bf16: the interpreter casts to bf16 by truncation, not to nearest (the GPU test covers bf16).
CASES = {
    "fp16_ragged_blocks": (70, 300, torch.float16, torch.float16),
    "fp16_one_row": (1, 40, torch.float16, torch.float16),
    "fp32": (65, 257, torch.float32, torch.float32),
    "fp16_rows_fp32_act": (33, 64, torch.float16, torch.float32),
}
# fold cases (T, k, H, weights dtype or None: unweighted with an fp32 add, out dtype, tile): fp16 products rounded
# to fp16, fp32 weights into an fp16 result (the cast in the pass), the backward's fold, tiles cut short
FOLD_CASES = {
    "fold_fp16_weights": (37, 4, 300, torch.float16, torch.float16, (16, 256, 4)),
    "fold_fp32_weights_fp16_out": (40, 3, 96, torch.float32, torch.float16, (16, 64, 4)),
    "fold_backward_fp32_add": (33, 2, 130, None, torch.float32, (8, 128, 4)),
}


def _check_case(S, I, dtype, act_dtype):
    import triton

    from kosmos.kernels import moe_rows
    from kosmos.ops import moe_math

    g = torch.Generator().manual_seed(S * I)
    h = (4 * torch.randn(S, 2 * I, generator=g)).to(dtype)
    want = moe_math._swiglu(h, act_dtype)[3]
    got = torch.full((S, I), float("nan"), dtype=act_dtype)
    moe_rows._swiglu_rows_kernel[(triton.cdiv(S, 64), triton.cdiv(I, 256))](h, got, S, I, BR=64, BC=256)
    # silu's exp is the one approximation: in fp32 it shows in the last bits, in fp16 the roundings hide it except
    # next to a rounding boundary (one value in thousands, one unit in the last place)
    differ = (got != want).sum().item()
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1e-30)).max().item()
    assert err <= (1e-6 if dtype == torch.float32 else 2.0**-10), (differ, err)
    assert dtype == torch.float32 or differ <= S * I // 1000, (differ, err)
    return {"differing": differ, "max_rel": err}


def _check_fold(T, k, H, w_dtype, out_dtype, tile):
    from kosmos.kernels import moe_rows
    from kosmos.ops import moe_math

    g = torch.Generator().manual_seed(T * k)
    rows = torch.randn(T * k + 5, H, generator=g).to(torch.float16)
    row = torch.randperm(T * k + 5, generator=g)[: T * k].view(T, k).contiguous()
    w = torch.rand(T, k, generator=g).to(w_dtype) if w_dtype is not None else None
    add = torch.randn(T, H, generator=g) if w is None else None
    if w is None:
        want = moe_math._fold(rows, row.view(-1), T, k, torch.float32, add=add)
    else:
        want = moe_math._fold_weighted(rows, row.view(-1), w, out_dtype)
    got = torch.full((T, H), float("nan"), dtype=out_dtype)
    moe_rows.launch_fold(rows, row, w, add, got, tile)
    assert got.dtype == want.dtype and torch.equal(got, want), (got.double() - want.double()).abs().max().item()
    return {"equal": True}


def _check_kept_launch():
    """launch_plan.launch keeps one launch per signature: a second fold of the same signature adds none and gives the
    same bits; rows 8 bytes off a 16-byte boundary, another row count and another constexpr each add one."""
    from kosmos.kernels import launch_plan, moe_rows

    launch_plan._launches.clear()
    g = torch.Generator().manual_seed(5)
    buf = torch.randn(41 * 48 + 4, generator=g).to(torch.float16)
    rows, shifted = buf[: 41 * 48].view(41, 48), buf[4 : 4 + 41 * 48].view(41, 48)
    row = torch.randperm(41, generator=g)[:40].view(20, 2).contiguous()
    outs = [torch.empty(20, 48) for _ in range(2)]
    for out in outs:
        moe_rows.launch_fold(rows, row, None, None, out, (8, 32, 4))
    assert len(launch_plan._launches) == 1 and torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], _torch_fold(rows, row))
    moe_rows.launch_fold(shifted, row, None, None, outs[0], (8, 32, 4))
    assert len(launch_plan._launches) == 2 and torch.equal(outs[0], _torch_fold(shifted, row))
    moe_rows.launch_fold(rows, row[:10], None, None, outs[1][:10], (8, 32, 4))
    assert len(launch_plan._launches) == 3 and torch.equal(outs[1][:10], _torch_fold(rows, row[:10]))
    moe_rows.launch_fold(rows, row, None, None, outs[1], (16, 32, 4))
    assert len(launch_plan._launches) == 4 and torch.equal(outs[1], _torch_fold(rows, row))
    return {"plans": len(launch_plan._launches)}


def _torch_fold(rows, row):
    from kosmos.ops import moe_math

    return moe_math._fold(rows, row.view(-1), row.shape[0], row.shape[1], torch.float32)


KEPT_CASES = {"kept_launch": ()}
# gather cases (source rows, elements per row, index length): one element a row (the per-pair weights, d_weights),
# a row narrower than the default tile, one wider; fp32 in, fp16 out, indices past the source read zeros
GATHER_CASES = {"gather_one_element_rows": (300, (), 700), "gather_narrow_rows": (50, (96,), 130),
                "gather_wide_rows": (40, (3, 100), 70)}


def _check_gather(N, row_shape, R):
    from kosmos.kernels import moe_rows

    g = torch.Generator().manual_seed(N + R)
    src = torch.randn(N, *row_shape, generator=g)
    index = torch.randint(-2, N + 3, (R,), generator=g)
    got = torch.full((R, *row_shape), float("nan"), dtype=torch.float16)
    moe_rows.launch_gather(src, index, got)
    inside = (index >= 0) & (index < N)
    want = torch.where(inside.view(-1, *[1] * len(row_shape)), src[index.clamp(0, N - 1)], 0).to(torch.float16)
    assert torch.equal(got, want)
    return {"outside": int((~inside).sum())}


def _main():
    cases = {f"case_{n}": (lambda c=c: _check_case(*c)) for n, c in CASES.items()}
    cases.update({f"case_{n}": (lambda c=c: _check_fold(*c)) for n, c in FOLD_CASES.items()})
    cases["case_kept_launch"] = _check_kept_launch
    cases.update({f"case_{n}": (lambda c=c: _check_gather(*c)) for n, c in GATHER_CASES.items()})
    _interp.run_cases(list(CASES) + list(FOLD_CASES) + list(KEPT_CASES) + list(GATHER_CASES), cases)


report, test_interpreted_case = _interp.case_tests(__file__, {**CASES, **FOLD_CASES, **KEPT_CASES, **GATHER_CASES},
                                                   timeout=300)


if __name__ == "__main__":
    _main()
