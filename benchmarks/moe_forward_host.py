"""Host time of one fused MoE forward call (kosmos.kernels.moe.moe_forward, the training forward: saved up rows,
logits and routing returned, as kosmos::moe_layer calls it) on one layer's dims: calls enqueued while the device
sleeps, so the host's own work is timed, not a wait on the device. Prints "AB" lines for benchmarks/ab_trees.sh:

    bash benchmarks/ab_trees.sh ../old . 2 benchmarks/moe_forward_host.py --layer qwen3_30b_a3b --T 4096
"""
from __future__ import annotations

import argparse
import time

import torch

from moe_trace import layer_inputs


def host_us(fn, calls: int, rounds: int, sleep_cycles: int = int(2e9)) -> list:
    """us per call of `calls` calls of fn, enqueued behind a device sleep of sleep_cycles (the default ~1 s at
    1.98 GHz; it must outlast the host's enqueueing), in each of `rounds` rounds."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return out


def main() -> None:
    from kosmos.kernels import moe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="qwen3_30b_a3b")
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    (hidden, rw, rb, corr, gu, down, k), kw = layer_inputs(args.layer, args.T)
    kw = dict(kw, return_router_logits=True, return_routing=True, save_up=True)

    def call():
        moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw)

    call()  # compile
    us = sorted(host_us(call, args.calls, args.rounds))
    print(f"AB {args.tag} {args.layer} T={args.T} moe_forward host: median {us[len(us) // 2]:.1f} us/call "
          f"(rounds {', '.join(f'{u:.1f}' for u in us)})", flush=True)


if __name__ == "__main__":
    main()
