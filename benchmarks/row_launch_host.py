"""Host time of the reference backward's row-kernel calls (kosmos.kernels.moe_rows, moe_pairs) on one layer's dims,
each launch through launch_plan.launch (the compiled kernel kept per argument signature) against Triton's JIT
binding on every call (kernel[grid](...), what they did before the sixtieth session). Calls are enqueued while the
device sleeps, so the host's own work is timed; the two ways alternate in each round.

    PYTHONPATH=.:benchmarks python3 benchmarks/row_launch_host.py --T 4096 [--E 128 --k 8 --H 2048 --I 768]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from moe_forward_host import host_us


def _jit_launch(kernel, grid, args, **meta):
    from kosmos.kernels import runtime

    kernel[grid](*args, **meta, **runtime.COMPILE_OPTIONS)


def main() -> None:
    from kosmos.kernels import launch_plan, moe_pairs, moe_rows

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--H", type=int, default=2048)
    p.add_argument("--I", type=int, default=768)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    T, E, k, H, I = args.T, args.E, args.k, args.H, args.I
    S, dev, bf16 = T * k, "cuda", torch.bfloat16
    ids = torch.randint(0, E, (T, k), device=dev, dtype=torch.int32)
    counts, token, pair, row, pads, ends = moe_pairs.sorted_pairs(ids, E)
    hidden = torch.randn(T, H, device=dev, dtype=bf16)
    d_w = torch.randn(S + E, device=dev)
    h = torch.randn(S + E, 2 * I, device=dev, dtype=bf16)
    d_au = torch.randn(S + E, I, device=dev, dtype=bf16)
    rows = torch.randn(S + E, H, device=dev, dtype=bf16)
    calls = {
        "sorted_pairs (4 launches)": lambda: moe_pairs.sorted_pairs(ids, E),
        "gather_rows hidden": lambda: moe_rows.gather_rows(hidden, token),
        "gather_rows d_weights": lambda: moe_rows.gather_rows(d_w, row, bf16),
        "swiglu_rows_backward": lambda: moe_rows.swiglu_rows_backward(h, d_au, d_w, in_place=True, act_w=d_au),
        "fold": lambda: moe_rows.fold(rows, row.view(T, k)),
    }
    kept_launch = launch_plan.launch
    got = {(name, way): [] for name in calls for way in ("jit", "kept")}
    for fn in calls.values():  # compile and keep
        fn()
    for _ in range(args.rounds):
        for way, launch in (("jit", _jit_launch), ("kept", kept_launch)):
            launch_plan.launch = launch
            try:
                for name, fn in calls.items():
                    got[name, way] += host_us(fn, args.calls, 1, sleep_cycles=int(1e8))  # ~50 ms at 1.98 GHz
            finally:
                launch_plan.launch = kept_launch
    print(f"T={T} E={E} k={k} H={H} I={I}: host us per call, median of {args.rounds} rounds of {args.calls} calls")
    print(f"{'call':28s} {'jit':>8s} {'kept':>8s}")
    for name in calls:
        jit, kept = statistics.median(got[name, "jit"]), statistics.median(got[name, "kept"])
        print(f"{name:28s} {jit:8.1f} {kept:8.1f}")


if __name__ == "__main__":
    main()
