"""SM clock and board power while the MoE layers' expert GEMMs run, against dense GEMMs of the same FLOPs: is a
grouped GEMM's lower rate its clock (the power cap, with each expert's weight streamed from HBM) or its work per
clock?

    PYTHONPATH=.:benchmarks python3 benchmarks/clocks.py --layer deepseek_v3 --T 16384 --seconds 3

Each workload is the forward's two expert GEMMs (up, then down) over T * k rows: dense (one [rows, H] x [H, 2I] and
one [rows, I] x [I, H] matmul, as moe.py's dense column: one expert's weight for every row), bmm (cuBLAS batched
over every expert's weight, rows / E rows each: the same weight traffic as the grouped GEMMs without their ragged
groups), torch._grouped_mm (CUTLASS) and kosmos's grouped_ws with m-fastest tiles (kosmos_mc: claimed from a
counter; kosmos_mcs: claimed, each tile's rows split between two consumers, what the MoE ops run), rows grouped as
grouped_mm.py's. After 2 s of heat, calls run back to back for --seconds while
`nvidia-smi -lms` samples the SM clock and the board power; the samples of the first 0.5 s are dropped. Printed: ms a
call (device time over the window), TF/s, median SM clock and power, and TF/s per GHz of SM clock (the work a clock
cycle does). --wgrad: the backward's two weight gradients instead (wgrad_workloads), whose FLOPs are the forward's:
where they run slower, is it the clock (their 22.5 GB of bf16 stores at DeepSeek-V3's size drawing power) or the
work per clock?
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from grouped_mm import LAYERS, cases, routed_ends
from measure import heat

SETTLE_S = 0.5


def sample_smi(samples: list, stop: threading.Event, period_ms: int = 50) -> None:
    """Appends (time, SM MHz, W) of GPU 0 every period_ms until stop is set."""
    query = ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
    proc = subprocess.Popen(query + ["-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if stop.is_set():
                break
            fields = [f.strip() for f in line.split(",")]
            try:
                samples.append((time.time(), float(fields[0]), float(fields[1])))
            except (ValueError, IndexError):
                continue
    finally:
        proc.terminate()


def run_window(fn, seconds: float) -> tuple[float, float, float, int]:
    """(ms a call, median SM MHz, median W, samples) of fn run back to back for `seconds` under nvidia-smi."""
    samples, stop = [], threading.Event()
    sampler = threading.Thread(target=sample_smi, args=(samples, stop), daemon=True)
    sampler.start()
    time.sleep(0.3)  # nvidia-smi's start-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, calls = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    t1 = time.time()
    stop.set()
    sampler.join(timeout=2)
    window = [s for s in samples if t0 + SETTLE_S <= s[0] <= t1]
    if not window:
        raise SystemExit("nvidia-smi gave no samples inside the window")
    return (start.elapsed_time(end) / calls, statistics.median(s[1] for s in window),
            statistics.median(s[2] for s in window), len(window))


def workloads(layer: str, T: int, k: int = 8):
    """name -> (callable, FLOPs of one call): the forward's up and down GEMMs, dense, batched and grouped two ways."""
    from kosmos.kernels.gemm_ws_host import grouped_mm

    H, I, E = LAYERS[layer]
    ends = routed_ends(T, E, k, torch.Generator().manual_seed(0)).cuda()
    S = int(ends[-1])
    gemms = cases(H, I, E, S, "cuda")
    (x, up_w), (act, down_w) = gemms["up (fwd, K-contig B)"], gemms["down (fwd, K-contig B)"]
    w1, w2 = up_w[0].contiguous(), down_w[0].contiguous()  # one expert's weights as dense [K, N] matrices
    up_out = x.new_empty(S, 2 * I)
    down_out = x.new_empty(S, H)
    m = S // E
    x_b, act_b = x[:E * m].view(E, m, H), act[:E * m].view(E, m, I)

    def flops(rows: int) -> int:
        return 2 * rows * H * 2 * I + 2 * rows * I * H

    return {
        "dense": (lambda: (x @ w1, act @ w2), flops(S)),
        "bmm": (lambda: (torch.bmm(x_b, up_w), torch.bmm(act_b, down_w)), flops(E * m)),
        "torch_grouped": (lambda: (torch._grouped_mm(x, up_w, offs=ends), torch._grouped_mm(act, down_w, offs=ends)),
                          flops(S)),
        "kosmos_m": (lambda: (grouped_mm(x, up_w, ends, out=up_out, m_fastest=True),
                              grouped_mm(act, down_w, ends, out=down_out, m_fastest=True)), flops(S)),
        "kosmos_mc": (lambda: (grouped_mm(x, up_w, ends, out=up_out, m_fastest=True, claim=True),
                               grouped_mm(act, down_w, ends, out=down_out, m_fastest=True, claim=True)), flops(S)),
        "kosmos_mcs": (lambda: (grouped_mm(x, up_w, ends, out=up_out, m_fastest=True, claim=True, config="128x256s"),
                                grouped_mm(act, down_w, ends, out=down_out, m_fastest=True, claim=True,
                                           config="128x256s")), flops(S)),
    }


def wgrad_workloads(layer: str, T: int, k: int = 8):
    """name -> (callable, FLOPs of one call): the backward's two weight gradients (d_gate_up = d_h^T x, d_down =
    g^T act, as grouped_mm.py --wgrad has them) by torch._grouped_mm and by kosmos's grouped_wgrad (the MoE ops'
    config for these rows), and their stores alone (wgrad_write: both gradients zeroed). Their FLOPs are the
    forward's up + down, so TF/s per GHz compares with the forward workloads' of another process."""
    from grouped_mm import wgrad_cases
    from kosmos.kernels.gemm_ws_host import grouped_wgrad, wgrad_config

    H, I, E = LAYERS[layer]
    ends = routed_ends(T, E, k, torch.Generator().manual_seed(0)).cuda()
    S = int(ends[-1])
    (d_h, x), (g, act) = wgrad_cases(H, I, S, "cuda").values()
    d_gate_up, d_down = d_h.new_empty(E, 2 * I, H), d_h.new_empty(E, H, I)
    config = wgrad_config(S, E)
    flops = 2 * S * H * 2 * I + 2 * S * I * H
    return {
        "wgrad_torch": (lambda: (torch._grouped_mm(d_h.t(), x, offs=ends), torch._grouped_mm(g.t(), act, offs=ends)),
                        flops),
        "wgrad_kosmos": (lambda: (grouped_wgrad(d_h, x, ends, out=d_gate_up, config=config),
                                  grouped_wgrad(g, act, ends, out=d_down, config=config)), flops),
        "wgrad_write": (lambda: (d_gate_up.zero_(), d_down.zero_()), flops),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="deepseek_v3", choices=sorted(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--impls", default="dense,bmm,torch_grouped,kosmos_m")
    p.add_argument("--wgrad", action="store_true",
                   help="the weight gradients' workloads instead (wgrad_torch, wgrad_kosmos, wgrad_write): one "
                        "process does not hold both sets at DeepSeek-V3's size on an 80 GB card")
    p.add_argument("--json", default="")
    args = p.parse_args()
    fns = wgrad_workloads(args.layer, args.T) if args.wgrad else workloads(args.layer, args.T)
    rows = []
    for name in args.impls.split(","):
        if name not in fns:
            raise SystemExit(f"--impls: unknown {name!r}; here: {sorted(fns)}")
        fn, flops = fns[name]
        heat(fn)
        ms, mhz, watts, n = run_window(fn, args.seconds)
        tflops = flops / ms / 1e9
        rows.append(dict(impl=name, ms=ms, tflops=tflops, sm_mhz=mhz, watts=watts, samples=n,
                         tflops_per_ghz=tflops / (mhz / 1000)))
    if args.wgrad:
        print(f"{args.layer} T={args.T}: the two weight gradients ({fns['wgrad_torch'][1] / 1e12:.2f} TFLOP a call; "
              f"wgrad_write: their stores alone)")
    else:
        print(f"{args.layer} T={args.T}: the forward's up + down GEMMs ({fns['dense'][1] / 1e12:.2f} TFLOP a call; "
              f"bmm {fns['bmm'][1] / 1e12:.2f})")
    print(f"{'impl':>14} | {'ms':>7} | {'TF/s':>6} | {'SM MHz':>6} | {'W':>5} | {'TF/s/GHz':>8} | samples")
    for r in rows:
        print(f"{r['impl']:>14} | {r['ms']:7.3f} | {r['tflops']:6.0f} | {r['sm_mhz']:6.0f} | {r['watts']:5.0f} | "
              f"{r['tflops_per_ghz']:8.1f} | {r['samples']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(layer=args.layer, T=args.T, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
