"""Where a timed MoE call's time goes between the host and the device: for HF's block under Inductor and under
backend="kosmos", forward (no_grad) and forward+backward, medians of measure.bench_calls synced (each call waited
for: the device idles while the host prepares the next) and back to back (moe.py's default), the same calls with the
device held busy by a sleep kernel while the host enqueues each one, and the host's own time per call; with --prof
the host time of the kosmos layers (perf_counter wrappers) and a cProfile of the host path. --sleeps: the forward's
time against the length of the sleep ahead of it.

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_host_probe.py --layer qwen3_235b --T 16384 --prof $OUT/prof.txt
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import time

import torch

from measure import _flush_buffer, bench_calls
from moe import LAYERS, build_block


def device_ms(fn, reps: int, sleep_cycles: int) -> float:
    """Median ms between events around fn() with a sleep kernel ahead of them: the host enqueues fn while the device
    sleeps, so host overhead that fits under the sleep is not counted (gaps inside the call still are)."""
    flush = _flush_buffer()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(sleep_cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def host_ms(fn, reps: int) -> float:
    """Median ms the host spends in fn() (no sync inside; the device drained before each call)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def profile_text(fn, calls: int, top: int) -> str:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    return s.getvalue()


@contextlib.contextmanager
def timed_calls(targets):
    """Within: each owner.attr of targets [(owner, attr, label)] appends its host ms per call to spent[label] (the
    yielded dict of lists); the originals come back after."""
    spent = collections.defaultdict(list)
    patched = []
    for owner, attr, label in targets:
        orig = getattr(owner, attr)

        def timed(*a, _orig=orig, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                spent[_label].append((time.perf_counter() - t0) * 1e3)

        setattr(owner, attr, timed)
        patched.append((owner, attr, orig))
    try:
        yield spent
    finally:
        for owner, attr, orig in reversed(patched):
            setattr(owner, attr, orig)


def breakdown_text(fn, reps: int) -> str:
    """Host time of fn and of the kosmos layers under it (perf_counter wrappers), median ms per call."""
    from kosmos.kernels import moe as kmoe
    from kosmos.ops import moe as omoe

    with timed_calls([(omoe, "_check_layer_args", "ops.moe._check_layer_args"),
                      (kmoe, "moe_forward", "kernels.moe.moe_forward"),
                      (kmoe, "_moe_forward", "kernels.moe._moe_forward"),
                      (kmoe.runtime, "check_grid_fits", "runtime.check_grid_fits"),
                      (kmoe._Control, "launch", "_Control.launch (Triton run)")]) as spent:
        total = host_ms(fn, reps)
    med = {k: sorted(v)[len(v) // 2] for k, v in spent.items()}
    return "\n".join([f"call {total:.3f} ms (host, median)"] + [f"    {k:32s} {v:.3f} ms x {len(spent[k]) // reps}"
                                                                 for k, v in med.items()])


def main(argv=None) -> int:
    import kosmos  # noqa: F401  (registers the backend)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="qwen3_235b", choices=list(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--variants", default="inductor,kosmos")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--sleep-ms", type=float, default=10.0, help="device sleep ahead of each call (at ~1.98 GHz)")
    p.add_argument("--prof", default="", help="file for the kosmos variant's cProfile text")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--sleeps", default="", help="comma-separated sleep ms: device-only time of each variant's forward "
                   "per sleep length (0: moe.py's timing without its warm-up), then nothing else")
    args = p.parse_args(argv)
    block, d = build_block(args.layer, "cuda", torch.bfloat16)
    x = torch.randn(1, args.T, d["H"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    params = [x] + list(block.parameters())
    cycles = int(args.sleep_ms * 1.98e6)
    rows = []
    prof_out = []
    for name in args.variants.split(","):
        torch._dynamo.reset()
        f = torch.compile(block) if name == "inductor" else torch.compile(block, backend=name)

        def fwd(f=f):
            with torch.no_grad():
                f(x)

        def step(f=f):
            torch.autograd.grad(f(x), params, g, allow_unused=True)

        if args.sleeps:
            for _ in range(3):
                fwd()
            bench_calls(fwd, 100, 300, args.reps)
            for ms in [float(v) for v in args.sleeps.split(",")] * 2:
                print(f"{name:>9} fwd sleep {ms:5.2f} ms: {device_ms(fwd, args.reps, int(ms * 1.98e6)):7.3f} ms",
                      flush=True)
            continue
        for kind, fn in (("fwd", fwd), ("fwd+bwd", step)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            synced = bench_calls(fn, 100, 300, args.reps, synced=True)
            stream = bench_calls(fn, 100, 300, args.reps)
            dev = device_ms(fn, args.reps, cycles)
            host = host_ms(fn, args.reps)
            rows.append((name, kind, synced, stream, dev, host))
            print(f"{name:>9} {kind:>8}: synced {synced:7.3f} stream {stream:7.3f} sleep-ahead {dev:7.3f} host "
                  f"{host:7.3f} ms", flush=True)
            if args.prof and name != "inductor":
                bd = breakdown_text(fn, args.reps)
                print(bd, flush=True)
                prof_out.append(f"{name} {kind} host breakdown: {bd}")
            if args.prof and name != "inductor":
                prof_out.append(f"#### {name} {kind}\n" + profile_text(fn, 5, args.top))
    if args.prof:
        with open(args.prof, "w") as fh:
            fh.write("\n".join(prof_out))
    print(f"\n{args.layer} T={args.T}: variant kind | synced calls | back to back | sleep ahead | host per call, ms")
    for r in rows:
        print(f"{r[0]:>9} {r[1]:>8} | " + " | ".join(f"{v:7.3f}" for v in r[2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
