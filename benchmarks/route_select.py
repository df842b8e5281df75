"""The reference forward's routing selection from the logits: kosmos.kernels.route_select (tile sizes and warps)
against torch's ops (kosmos.ops.moe_math._route_forward on the same logits: scores, group masks, torch.topk, the
gather and the renormalisation), device time per call (measure.bench_graph: CUDA-graph replays, L2 flushed), for
Qwen3-MoE's router (bf16 softmax, top-8 of 128) and DeepSeek-V3's (fp32 sigmoid with its correction bias, top-8 of
256 in 8 groups keeping 4, x2.5).

    PYTHONPATH=.:benchmarks python3 benchmarks/route_select.py --ts 4096,8192,16384
"""
from __future__ import annotations

import argparse

import torch

from measure import bench_graph

ROUTERS = {  # E, k, scoring, norm, n_group, topk_group, scaling, logits dtype, with a correction bias
    "qwen3": (128, 8, "softmax", True, 1, 1, 1.0, torch.bfloat16, False),
    "deepseek_v3": (256, 8, "sigmoid", True, 8, 4, 2.5, torch.float32, True),
}
# (rows per program, warps): route_select's default (tile_rows, NUM_WARPS) first
CONFIGS = [(None, 4), (8, 4), (8, 8), (16, 8), (32, 8)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ts", default="4096,8192,16384")
    p.add_argument("--routers", default=",".join(ROUTERS))
    args = p.parse_args()
    from kosmos.kernels import route_select
    from kosmos.ops import moe_math

    print(f"{'router':>12} {'T':>6} {'impl':>18} {'ms':>8}")
    for name in args.routers.split(","):
        E, k, scoring, norm, n_group, topk_group, scale, dtype, with_bias = ROUTERS[name]
        eps = moe_math._SIGMOID_NORM_EPS if scoring == "sigmoid" else 0.0
        for T in map(int, args.ts.split(",")):
            g = torch.Generator(device="cuda").manual_seed(T)
            logits = (3 * torch.randn(T, E, device="cuda", generator=g)).to(dtype)
            bias = torch.randn(E, device="cuda", generator=g) * 0.1 if with_bias else None
            hidden, rw = torch.empty(T, 1, device="cuda"), torch.empty(E, 1, device="cuda")  # (logits given)

            def torch_ops():
                return moe_math._route_forward(hidden, rw, None, bias, k, scoring, norm, n_group, topk_group, scale,
                                               None, logits=logits)[1:3]

            print(f"{name:>12} {T:>6} {'torch ops':>18} {bench_graph(torch_ops):8.4f}", flush=True)
            for tile, warps in CONFIGS:
                def kernel(tile=tile, warps=warps):
                    return route_select.select(logits, bias, k, scoring, norm, n_group, topk_group, scale, eps,
                                               tile=tile, num_warps=warps)

                label = f"kernel {tile or 'default'}x{warps}w"
                print(f"{name:>12} {T:>6} {label:>18} {bench_graph(kernel):8.4f}", flush=True)


if __name__ == "__main__":
    main()
