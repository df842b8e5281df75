"""Where the time of one MoE layer step goes: GPU kernel times (torch.profiler) per variant of benchmarks/moe.py.

    PYTHONPATH=. python3 benchmarks/moe_profile.py --only qwen3_235b --ts 16384 --json prof.json
    PYTHONPATH=. python3 benchmarks/moe_profile.py --tiny      # CPU smoke run of the script (no CUDA kernels)

For each layer, T and variant (Inductor, kosmos with the op's reference impls, kosmos default), and each of
forward / forward+backward: a few warm-up steps, then --steps profiled steps; every GPU kernel's total device
time divided by the steps, largest first (--top of them), with the sum over all kernels. Kernel times under the
profiler are device times of the kernels themselves: gaps between kernels (launch cost, host sync) are not in
the sum, so the sum can be below the layer's time in benchmarks/moe.py.

--gaps: also where the device idles inside the same profiled steps: the span of the steps' kernels, the time no kernel
runs (launch gaps, host syncs, host-bound stretches), and the largest gaps with the kernels on either side.

--ops NAME (e.g. _grouped_mm): also the ops whose name contains NAME, one line per op and input shapes, with
their calls and their kernels' device time per step (record_shapes; on the CPU their CPU time): which of a
variant's grouped matmuls is slow, and with which operand shapes.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json

import torch

from kosmos.kernels.moe_ops import fused_env
from moe import KOSMOS_MODES, LAYERS, build_block, variants

VARIANTS = ("inductor", "kosmos_ref", "kosmos_default")  # or any other of moe.KOSMOS_MODES


def profiled_events(step, steps: int, device: str) -> list:
    """The profiler's events of `steps` back-to-back calls of step() after 3 warm-up calls (GPU activity on CUDA,
    CPU activity on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return list(prof.events())


def kernel_totals(events: list, steps: int, device: str) -> dict:
    """name -> device ms per step of every GPU kernel among `events` (profiled_events of `steps` calls)."""
    totals = collections.Counter()
    for ev in events:
        if device == "cuda" and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time if device == "cuda" else ev.cpu_time
        totals[ev.name] += us / 1000.0 / steps
    return dict(totals)


def kernel_times(step, steps: int, device: str) -> dict:
    """name -> device ms per step of every GPU kernel run by `steps` calls of step()."""
    return kernel_totals(profiled_events(step, steps, device), steps, device)


def timeline_gaps(events: list, steps: int, device: str, top: int = 8) -> dict:
    """span / busy / idle ms per step of the GPU kernels among `events` (profiled_events of `steps` back-to-back
    calls), and the `top` largest idle gaps as (us, kernel before, kernel after). On the CPU the same over the CPU
    ops (a smoke test)."""
    kind = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    kernels = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in events if ev.device_type == kind)
    gaps, busy, reach, before = [], 0.0, None, None
    for start, end, name in kernels:
        if reach is None or start > reach:
            if reach is not None:
                gaps.append((start - reach, before, name))
            busy += end - start
            reach, before = end, name
        elif end > reach:
            busy += end - reach
            reach, before = end, name
    span = (reach - kernels[0][0]) if kernels else 0.0
    gaps.sort(key=lambda g: -g[0])
    return dict(span_ms=span / 1000.0 / steps, busy_ms=busy / 1000.0 / steps, idle_ms=(span - busy) / 1000.0 / steps,
                gaps=[(round(us, 1), a[:60], b[:60]) for us, a, b in gaps[:top]])


def op_times(step, steps: int, device: str, match: str) -> dict:
    """(op name, input shapes) -> (calls per step, device ms per step of its kernels) for every op whose name
    contains `match` (CPU ms per step on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    out = {}
    for avg in prof.key_averages(group_by_input_shape=True):
        if match in avg.key:
            us = getattr(avg, "device_time_total", 0.0) if device == "cuda" else avg.cpu_time_total
            out[(avg.key, str(avg.input_shapes))] = (avg.count / steps, us / 1000.0 / steps)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated substrings of layer names")
    p.add_argument("--ts", default="16384")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--ops", default="", help="also time the ops whose name contains this, by input shapes")
    p.add_argument("--gaps", action="store_true", help="also the device's idle time between kernels")
    p.add_argument("--json", default="")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny dims, fp32: checks the script runs")
    args = p.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    out = []
    for layer in LAYERS:
        if args.only and not any(part in layer for part in args.only.split(",")):
            continue
        for T in map(int, args.ts.split(",")):
            block, d = build_block(layer, device, dtype, args.tiny)
            T = min(T, 64) if args.tiny else T
            x = torch.randn(1, T, d["H"], device=device, dtype=dtype, requires_grad=True)
            g = torch.randn_like(x)
            params = [x] + list(block.parameters())
            fns = variants(block)
            for name in args.variants.split(","):
                f = fns["inductor" if name == "inductor" else "kosmos"]
                env = fused_env(KOSMOS_MODES[name]) if name in KOSMOS_MODES else contextlib.nullcontext()
                with env:
                    def fwd(f=f):
                        with torch.no_grad():
                            f(x)

                    def fwdbwd(f=f):
                        torch.autograd.grad(f(x), params, g, allow_unused=True)

                    for kind, step in (("fwd", fwd), ("fwdbwd", fwdbwd)):
                        events = profiled_events(step, args.steps, device)
                        times = kernel_totals(events, args.steps, device)
                        total = sum(times.values())
                        out.append(dict(layer=layer, T=T, variant=name, kind=kind, total_ms=total, kernels=times))
                        print(f"\n## {layer} T={T} {name} {kind}: kernels sum {total:.3f} ms/step", flush=True)
                        for k, ms in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
                            print(f"{ms:9.3f} ms {100 * ms / max(total, 1e-9):5.1f}%  {k[:110]}", flush=True)
                        if args.gaps:
                            tl = timeline_gaps(events, args.steps, device)
                            out[-1]["timeline"] = tl
                            print(f"   span {tl['span_ms']:.3f} busy {tl['busy_ms']:.3f} idle {tl['idle_ms']:.3f}"
                                  " ms/step; largest gaps (us, before, after):", flush=True)
                            for gap in tl["gaps"]:
                                print(f"   gap {gap[0]:8.1f}  {gap[1]}  ->  {gap[2]}", flush=True)
                        if args.ops:
                            ops = op_times(step, args.steps, device, args.ops)
                            out[-1]["ops"] = {f"{k[0]} {k[1]}": v for k, v in ops.items()}
                            for (op, shapes), (calls, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
                                print(f"   op {ms:9.3f} ms {calls:5.1f} calls  {op} {shapes[:160]}", flush=True)
            del fns, block
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
