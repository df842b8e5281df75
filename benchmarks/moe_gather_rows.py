"""Times the MoE reference's row kernels at the layer dims of the MoE issue (one H200 in RESULTS.md): the gather into
expert-sorted rows, torch (index_select + index_fill_) vs kosmos.kernels.moe_rows.gather_rows; with --fold, the
forward's weighted fold (bf16 rows, the layer's routing weights, hidden's bf16 out) and the backward's (fp32 sum of
bf16 rows plus an fp32 add) over fold tiles (tokens, columns, warps), moe_rows.FOLD_TILE first (device ms per call:
measure.bench_graph, CUDA-graph replays, L2 flushed).

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_gather_rows.py [--fold]
"""
import argparse

import torch
import triton

import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)
from kosmos.ops import dispatch, moe_math

CASES = [("qwen3_235b", 16384, 4096, 128), ("deepseek_v3", 16384, 7168, 256), ("qwen3_30b", 4096, 2048, 128)]
FOLD_TILES = [(8, 256, 4), (16, 256, 4), (32, 256, 4), (4, 256, 4), (8, 128, 4), (16, 128, 4), (8, 512, 4),
              (8, 1024, 8)]


def gather(name, T, H, rows) -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    fused = rows.gather(x)
    ms_kernel = triton.testing.do_bench(lambda: rows.gather(x), warmup=50, rep=300)
    kernel = dispatch.row_kernel
    dispatch.row_kernel = lambda op, device: None
    try:
        ref = rows.gather(x)
        ms_torch = triton.testing.do_bench(lambda: rows.gather(x), warmup=50, rep=300)
    finally:
        dispatch.row_kernel = kernel
    gb = fused.numel() * fused.element_size() / 1e9
    print(f"{name} T={T} gather: equal={torch.equal(fused, ref)} torch {ms_torch:.3f} ms ({gb / ms_torch:.2f} TB/s "
          f"written) kernel {ms_kernel:.3f} ms ({gb / ms_kernel:.2f} TB/s)", flush=True)


def fold(name, T, H, rows, k) -> None:
    from kosmos.kernels import moe_rows
    from measure import bench_graph

    y = torch.randn(rows.row.numel() + len(rows.pads), H, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(T, k, device="cuda", dtype=torch.float32 if name == "deepseek_v3" else torch.bfloat16)
    add = torch.randn(T, H, device="cuda")
    row = rows.row.view(T, k)
    want = moe_rows.fold(y, row, w, dtype=torch.bfloat16), moe_rows.fold(y, row, add=add)
    for tile in FOLD_TILES:
        got = moe_rows.fold(y, row, w, dtype=torch.bfloat16, tile=tile), moe_rows.fold(y, row, add=add, tile=tile)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        fwd = bench_graph(lambda tile=tile: moe_rows.fold(y, row, w, dtype=torch.bfloat16, tile=tile))
        bwd = bench_graph(lambda tile=tile: moe_rows.fold(y, row, add=add, tile=tile))
        print(f"{name} T={T} fold {tile}: forward {fwd:.4f} ms, backward {bwd:.4f} ms, same bits {same}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fold", action="store_true", help="also the fold over tiles")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    for name, T, H, E in CASES:
        torch.manual_seed(0)
        ids = torch.stack([torch.randperm(E, device="cuda")[:8] for _ in range(T)])
        rows = moe_math._SortedPairs(ids, E)
        gather(name, T, H, rows)
        if args.fold:
            fold(name, T, H, rows, 8)


if __name__ == "__main__":
    main()
