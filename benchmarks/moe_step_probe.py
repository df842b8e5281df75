"""One MoE layer's training step under backend="kosmos", default env vs another setting of one env variable
(--b-env, default KOSMOS_FUSED_MOE=forward), in alternation (--rounds): per-step CUDA-event times (no L2 flush) of
the forward alone (no_grad) and of forward+backward, host wall time, the profiler's kernel-time sum (and how much of
it overlaps: kernels on two streams at once), and the caching allocator's counters over the timed steps (device
allocs / frees / retries: nonzero means the step pays cudaMalloc).

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_step_probe.py --layer deepseek_v3 --T 16384
    PYTHONPATH=.:benchmarks python3 benchmarks/moe_step_probe.py --layer qwen3_235b --b-env KOSMOS_GROUPED_SWIGLU=0

--grads: no timing; one step's gradients (input and every parameter) on each side, the B side's and HF eager's
(--eager) relative error against the A side's, and whether they are bit-equal.
"""
from __future__ import annotations

import argparse
import time

import torch

from grouped_mm import rel_err
from kosmos.kernels.moe_ops import env_var
from moe import LAYERS, build_block
from moe_profile import kernel_totals, profiled_events, timeline_gaps

KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def event_ms(fn, steps: int) -> list:
    """Sorted CUDA-event times of `steps` back-to-back calls of fn (ms)."""
    events = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in events)


def main(argv=None) -> int:
    import kosmos  # noqa: F401  (registers the backend)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="deepseek_v3", choices=list(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--b-env", default="KOSMOS_FUSED_MOE=forward", help="NAME=VALUE of the B side (A: NAME unset)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--grads", action="store_true", help="compare one step's gradients instead of timing")
    p.add_argument("--eager", action="store_true", help="with --grads: HF eager's gradients too")
    args = p.parse_args(argv)
    name, value = args.b_env.split("=", 1)
    block, d = build_block(args.layer, "cuda", torch.bfloat16)
    x = torch.randn(1, args.T, d["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    params = [x] + list(block.parameters())
    f = torch.compile(block, backend="kosmos")

    def step():
        torch.autograd.grad(f(x), params, g, allow_unused=True)

    def forward():
        with torch.no_grad():
            f(x)

    if args.grads:
        return compare_grads(block, f, x, g, params, name, value, args.eager)
    for env in (None, value) * args.rounds:
        with env_var(name, env):
            for _ in range(3):
                forward()
                step()
            fwd = event_ms(forward, args.steps)
            torch.cuda.synchronize()
            st0 = torch.cuda.memory_stats()
            ms = event_ms(step, args.steps)
            st1 = torch.cuda.memory_stats()
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 3 * 1e3
            events = profiled_events(step, 3, "cuda")
            kernels = kernel_totals(events, 3, "cuda")
            busy = timeline_gaps(events, 3, "cuda")["busy_ms"]  # the union of the kernels' spans
            print(f"{name}={env}: fwd ms median {fwd[len(fwd) // 2]:.2f} min {fwd[0]:.2f}; step ms median "
                  f"{ms[len(ms) // 2]:.2f} min {ms[0]:.2f} max {ms[-1]:.2f}; host wall {wall:.2f}; kernel sum "
                  f"{sum(kernels.values()):.2f}, of it overlapped {sum(kernels.values()) - busy:.2f}; "
                  + " ".join(f"{k}={st1[k] - st0[k]}" for k in KEYS), flush=True)
            for kname, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"   {v:8.2f} ms  {kname[:100]}")
    return 0


def compare_grads(block, f, x, g, params, name: str, value: str, eager: bool) -> int:
    """Prints, per gradient, the B side's (and HF eager's) relative error against the default env's (A's)."""
    names = ["input"] + [n for n, _ in block.named_parameters()]

    def grads(fn, device=None):
        return [t if t is None else t.detach().to(device, copy=True)
                for t in torch.autograd.grad(fn(x), params, g, allow_unused=True)]

    with env_var(name, None):
        want = grads(f, "cpu")  # (DeepSeek-V3's 22 GB of gradients would not fit twice beside the step)
    sides = [(f"{name}={value}", value, f)] + ([("HF eager", None, block)] if eager else [])
    for label, env, fn in sides:
        with env_var(name, env):
            got = grads(fn)
        for n, a, b in zip(names, got, want):
            if a is None or b is None:
                print(f"{label}: {n}: no gradient ({a is None}, {b is None})")
                continue
            b = b.to(a.device)
            err = rel_err(a, b)
            print(f"{label} vs default: {n}: rel err {err:.2e}, bit-equal {torch.equal(a, b)}", flush=True)
            del b
        del got
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
