"""DeepSeek-V3's fp32 router on bf16 hidden states in the reference forward: kosmos.kernels.router_gemm (tile
configs) against torch's `F.linear(hidden.float(), weight)` with TF32 off (the fp32 copy of hidden included, as the
router runs it), device time per call (measure.bench_graph: CUDA-graph replays, L2 flushed), and each one's max
error against the fp64 product over its max.

    PYTHONPATH=.:benchmarks python3 benchmarks/router_gemm.py --ts 4096,8192,16384
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from measure import bench_graph

# (rbm, rbn, bkg, num_warps, num_stages): router_gemm.CONFIGS' and others
CONFIGS = [(128, 128, 32, 8, 4), (128, 128, 64, 8, 3), (64, 128, 32, 4, 4), (64, 128, 64, 4, 3), (128, 256, 32, 8, 3)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ts", default="4096,8192,16384")
    p.add_argument("--H", type=int, default=7168)
    p.add_argument("--E", type=int, default=256)
    args = p.parse_args()
    from kosmos.kernels import router_gemm
    from kosmos.kernels.moe import split_router_weight

    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{'T':>6} {'impl':>22} {'ms':>8} {'max rel err':>12}")
    for T in map(int, args.ts.split(",")):
        g = torch.Generator(device="cuda").manual_seed(T)
        hidden = torch.randn(T, args.H, device="cuda", generator=g).bfloat16()
        weight = torch.randn(args.E, args.H, device="cuda", generator=g) / args.H**0.5
        want = hidden.double() @ weight.double().T

        def err(x):
            return ((x.double() - want).abs().max() / want.abs().max()).item()

        runs = {"torch fp32 linear": lambda: F.linear(hidden.float(), weight),
                "kosmos (config, split)": lambda: router_gemm.router_logits(hidden, weight)}
        parts = split_router_weight(weight)
        for c in CONFIGS:
            runs["kosmos %dx%dx%d w%d s%d" % c] = (lambda c=c: router_gemm.launch(
                hidden, parts, None, rbm=c[0], rbn=c[1], bkg=c[2], num_warps=c[3], num_stages=c[4]))
        for name, fn in runs.items():
            try:
                ms = bench_graph(fn)
                print(f"{T:>6} {name:>22} {ms:8.3f} {err(fn()):12.3g}", flush=True)
            except Exception as e:  # noqa: BLE001  (a config that does not fit: say so, time the rest)
                print(f"{T:>6} {name:>22} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        del want


if __name__ == "__main__":
    main()
