"""Times the MoE backward's gather into expert-sorted rows: torch (index_select + index_fill_) vs the Triton row
kernel kosmos.kernels.moe_rows.gather_rows, at the layer dims of the MoE issue (one H200 in RESULTS.md).

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_gather_rows.py
"""
import torch
import triton

import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)
from kosmos.ops import dispatch, moe

CASES = [("qwen3_235b", 16384, 4096, 128), ("deepseek_v3", 16384, 7168, 256), ("qwen3_30b", 4096, 2048, 128)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    kernel = dispatch.row_kernel
    for name, T, H, E in CASES:
        torch.manual_seed(0)
        ids = torch.stack([torch.randperm(E, device="cuda")[:8] for _ in range(T)])
        rows = moe_math._SortedPairs(ids, E)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        fused = rows.gather(x)
        ms_kernel = triton.testing.do_bench(lambda: rows.gather(x), warmup=50, rep=300)
        dispatch.row_kernel = lambda op, device: None
        try:
            ref = rows.gather(x)
            ms_torch = triton.testing.do_bench(lambda: rows.gather(x), warmup=50, rep=300)
        finally:
            dispatch.row_kernel = kernel
        gb = fused.numel() * fused.element_size() / 1e9
        print(f"{name} T={T}: equal={torch.equal(fused, ref)} torch {ms_torch:.3f} ms ({gb / ms_torch:.2f} TB/s "
              f"written) kernel {ms_kernel:.3f} ms ({gb / ms_kernel:.2f} TB/s)")


if __name__ == "__main__":
    main()
