"""Median time of the fused MoE forward kernel alone (kosmos.kernels.moe.moe_forward, its default config) on one
layer's dims and router (moe_trace.layer_inputs: random weights, DeepSeek-V3's real router), after 2 s of heating:
measure.bench_calls (>= 20 calls, L2 flushed). To compare two kernel builds, run it from two checkouts in
alternation on the same GPU (each process imports the kosmos of its own tree):

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_kernel_time.py --layer deepseek_v3 --tag new
    (cd ../old && PYTHONPATH=.:benchmarks python3 benchmarks/moe_kernel_time.py --layer deepseek_v3 --tag old)
"""
from __future__ import annotations

import argparse

import torch

from measure import bench_calls, heat
from moe_trace import layer_inputs


def main() -> None:
    from kosmos.kernels import moe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="deepseek_v3")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--tag", default="", help="a label for the printed line")
    args = p.parse_args()
    (hidden, rw, rb, corr, gu, down, k), kw = layer_inputs(args.layer, args.T)

    def forward():
        return moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw)

    forward()
    torch.cuda.synchronize()
    heat(forward, 2.0)
    print(f"AB {args.tag} {args.layer} {bench_calls(forward, 200, 600, 20):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
