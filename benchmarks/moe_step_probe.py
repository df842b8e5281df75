"""One MoE layer's training step under backend="kosmos", default env vs KOSMOS_FUSED_MOE=forward, in alternation:
per-step CUDA-event times (no L2 flush), host wall time, the profiler's kernel-time sum, and the caching
allocator's counters over the timed steps (device allocs / frees / retries: nonzero means the step pays cudaMalloc).

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_step_probe.py --layer deepseek_v3 --T 16384
"""
from __future__ import annotations

import argparse
import time

import torch

from kosmos.kernels.moe_ops import fused_env
from moe import LAYERS, build_block
from moe_profile import kernel_times

KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def main(argv=None) -> int:
    import kosmos  # noqa: F401  (registers the backend)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="deepseek_v3", choices=list(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=8)
    args = p.parse_args(argv)
    block, d = build_block(args.layer, "cuda", torch.bfloat16)
    x = torch.randn(1, args.T, d["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    params = [x] + list(block.parameters())
    f = torch.compile(block, backend="kosmos")

    def step():
        torch.autograd.grad(f(x), params, g, allow_unused=True)

    for env in (None, "forward", None, "forward"):
        with fused_env(env):
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            st0 = torch.cuda.memory_stats()
            events = []
            for _ in range(args.steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                events.append((a, b))
            torch.cuda.synchronize()
            st1 = torch.cuda.memory_stats()
            ms = sorted(a.elapsed_time(b) for a, b in events)
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 3 * 1e3
            kernels = kernel_times(step, 3, "cuda")
            print(f"env={env}: step ms median {ms[len(ms) // 2]:.2f} min {ms[0]:.2f} max {ms[-1]:.2f}; host wall "
                  f"{wall:.2f}; kernel sum {sum(kernels.values()):.2f}; "
                  + " ".join(f"{k}={st1[k] - st0[k]}" for k in KEYS), flush=True)
            for name, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"   {v:8.2f} ms  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
