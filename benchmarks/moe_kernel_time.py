"""Median time of the fused MoE forward kernel alone (kosmos.kernels.moe.moe_forward) on one layer's dims and router
(moe_trace.layer_inputs: random weights, DeepSeek-V3's real router), after 2 s of heating: measure.bench_calls
(>= 20 calls, L2 flushed). --variants times MoeConfig variants of forward_configs' first config in --rounds
interleaved rounds (one process: each build compiles once); to compare two kernel trees, run it from both checkouts
in alternation on the same GPU (benchmarks/ab_trees.sh: each process imports the kosmos of its own tree and has
caches of its own):

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_kernel_time.py --layer deepseek_v3 --variants "default;num_stages=4"
    bash benchmarks/ab_trees.sh ../old . 2 benchmarks/moe_kernel_time.py --layer deepseek_v3

The ninth session ran the first form of this script (default config, --tag only) from two checkouts.
"""
from __future__ import annotations

import argparse

import torch

from measure import bench_calls, heat
from moe_trace import config_variant, layer_inputs


def main() -> None:
    from kosmos.kernels import moe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="deepseek_v3")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--variants", default="default", help="';'-separated: 'default' or field=value,...")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tag", default="", help="a label for the printed lines")
    p.add_argument("--save-up", action="store_true", help="the training forward: with the saved up rows")
    p.add_argument("--check", action="store_true",
                   help="also compare each variant's outputs with the first's, bit for bit")
    args = p.parse_args()
    (hidden, rw, rb, corr, gu, down, k), kw = layer_inputs(args.layer, args.T)
    base = moe.forward_configs(hidden, gu, k)[0]
    variants = args.variants.split(";")
    fns = {}
    for v in variants:
        cfg = config_variant(base, v)
        fns[v] = lambda cfg=cfg: moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw, config=cfg,
                                                 save_up=args.save_up)
        fns[v]()  # compile
    torch.cuda.synchronize()
    if args.check:
        first = fns[variants[0]]()
        for v in variants[1:]:
            got = fns[v]()
            same = all(torch.equal(a, b) for a, b in zip(first, got))
            diff = max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in zip(first, got))
            print(f"CHECK {args.tag} {args.layer} T={args.T} {v} vs {variants[0]}: "
                  f"{'same bits' if same else f'DIFFERENT (max abs diff {diff:.3g})'}", flush=True)
    heat(fns[variants[0]], 2.0)
    for r in range(args.rounds):
        for v in variants:
            up = " save_up" if args.save_up else ""
            print(f"AB {args.tag} {args.layer}{up} round {r} {v}: {bench_calls(fns[v], 200, 600, 20):.3f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
