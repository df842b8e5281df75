"""Measurement helpers shared by the benchmarks: device time from CUDA-graph replays (L2 flushed between
calls), GPU heating before a timing, one call under the profiler (for ncu), relative error."""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

_FLUSH = None


def _flush_buffer() -> torch.Tensor:
    """256 MB on the GPU whose zero_() evicts the L2 (made once)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    return _FLUSH


def bench_graph(fn, calls: int = 20, replays: int = 7) -> float:
    """Device time of one fn() in ms, launch cost excluded: a CUDA graph of `calls` x (L2 flush, fn) and one of
    `calls` x (L2 flush) are each replayed `replays` times; median difference / calls."""
    flush = _flush_buffer()
    fn()  # warm: compile, caches
    torch.cuda.synchronize()
    times = {}
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                flush.zero_()
                if with_fn:
                    fn()
        g.replay()
        torch.cuda.synchronize()
        ms = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        times[with_fn] = statistics.median(ms)
        del g
    return (times[True] - times[False]) / calls


def bench_calls(fn, warmup_ms: float, rep_ms: float, min_reps: int = 10, synced: bool = False,
                samples: Optional[list] = None) -> float:
    """Median ms of fn() over max(min_reps, rep_ms worth) calls after warmup_ms worth, L2 flushed before each (CUDA
    events around each call). triton's do_bench sizes its repeats by rep alone: a 90 ms training step with rep=40
    is timed ONCE (the MoE benchmarks' large-layer fwd+bwd figures up to the eighth session were such single
    calls).

    By default the calls are enqueued back to back and the host synchronizes once at the end, as do_bench does and
    as a training loop runs: the host's launch work overlaps the device's previous call, and the device stays busy
    (at its loaded clock). synced=True waits for each call before the next (the ninth to thirteenth sessions' timing):
    each call then also pays the host time before its first kernel starts and the clock's ramp from an idle device
    (measured on the H200, benchmarks/moe_host_probe.py, RESULTS.md fourteenth session: 1.0-1.6 ms on a 9 ms MoE
    forward, falling as a device-side sleep ahead of the call grows to 5 ms). samples: a list that gets every timed
    call's ms, in call order."""
    flush = _flush_buffer()

    def once() -> float:
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def stream(n: int) -> list:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    est = min(once() for _ in range(2))
    warm = int(warmup_ms / max(est, 1e-3))
    reps = max(min_reps, int(rep_ms / max(est, 1e-3)))
    if synced:
        for _ in range(warm):
            once()
        times = [once() for _ in range(reps)]
    else:
        stream(warm)
        times = stream(reps)
    if samples is not None:
        samples.extend(times)
    return sorted(times)[len(times) // 2]


def window_spread(times: list) -> float:
    """(slowest - fastest) / median of one timing window's calls after its first, which also pays the host's start:
    how far that window's median could have landed (RESULTS.md, sixty-sixth session). nan with fewer than three."""
    rest = sorted(times[1:])
    if len(rest) < 2:
        return float("nan")
    return (rest[-1] - rest[0]) / rest[len(rest) // 2]


def heat(fn, seconds: float = 2.0, flush: bool = False) -> None:
    """Runs fn back to back for `seconds`: the GPU's clocks settle at their loaded (power-capped) level, so
    the first timing of a run is not taken at an idle GPU's boost clock. The host waits for the chunk of calls
    before the one it has just enqueued, so the device never idles for the host's check. flush: an L2 flush before
    each call, as bench_calls times them (the heat then runs exactly the timed loop)."""
    buf = _flush_buffer() if flush else None
    t_end = time.time() + seconds
    queued = None
    while time.time() < t_end:
        for _ in range(20):
            if buf is not None:
                buf.zero_()
            fn()
        done = torch.cuda.Event()
        done.record()
        if queued is not None:
            queued.synchronize()
        queued = done
    torch.cuda.synchronize()


def profile_one(fn) -> None:
    """One fn() between cudaProfilerStart / Stop (for `ncu --profile-from-start off`: the counters of exactly that
    call); warm fn first."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in fp32 (the Frobenius norm over all elements)."""
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def speedup_plot(path: str, labels, curves: dict, baseline: str, target: Optional[float] = None) -> None:
    """Two panels, forward and forward+backward, of speed-up curves over `baseline`: curves["fwd" | "fwdbwd"]
    maps a name to its values, one per label (NaN where missing); a gray line at 1, a dashed one at `target` if
    given. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, kind in zip(axes, ("fwd", "fwdbwd")):
        for name, ys in curves[kind].items():
            ax.plot(labels, ys, marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.5)
        if target is not None:
            ax.axhline(target, color="gray", lw=0.8, ls="--", label=f"{target}x target")
        ax.set_title(f"{kind}: speed-up over {baseline}")
        ax.tick_params(axis="x", labelsize=6, labelrotation=45)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
