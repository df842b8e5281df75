"""Benchmarks of the fused TP+SP kernels (kosmos.kernels.ag_gemm / gemm_rs).

Two modes:

  python benchmarks/tp_sp.py --mode queue [--out results.json]
      One GPU. Queue overhead: the fused kernels with every comm task executed (publish, pulls, pushes,
      reduces), at W=1 and on SimWorld W=8 (8 simulated ranks sharing the GPU), against the persistent GEMM
      core (kosmos.kernels.gemm) doing the same total work. Target: <= 3% at W=1.

  torchrun --nproc-per-node N benchmarks/tp_sp.py --mode dist [--shapes small|full] [--out r.json] [--plot r.png]
      N GPUs of one host (benchmarks/tp_sp_dist.py): per shape, NCCL + cuBLAS in sequence, the GEMM and the
      collective alone (bound = the larger), PyTorch async-TP and kosmos::ag_gemm / kosmos::gemm_rs; kosmos'
      speed-ups and its time over the bound. NVLink multicast stays off (set NCCL_NVLS_ENABLE=0
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; this script sets them if unset).

Shapes are (M, K, N) of the whole GEMM: M gathered rows (AG) / rows before the scatter (RS).
Prints a table last; --out writes every number as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kosmos
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_sp_dist

AG_SHAPES = [(8192, 4096, 4096), (16384, 4096, 6144), (8192, 4096, 14336)]
RS_SHAPES = [(8192, 4096, 4096), (16384, 4096, 4096), (8192, 14336, 4096)]


def tflops(M, K, N, ms, copies=1) -> float:
    return 2.0 * M * K * N * copies / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ queue mode


def queue_mode(args) -> list[dict]:
    """Per shape: every candidate checked first, the GPU heated, then `rounds` rounds timing each candidate
    in turn (CUDA-graph replays, L2 flushed); a figure is the median over its rounds. Candidates: cuBLAS,
    the GEMM core, the core with its tile loop nested (the loop structure of a claim loop), and the fused
    op at W = 1 and SimWorld W = 8 (AG+GEMM with and without the gathered buffer returned)."""
    import statistics

    from measure import bench_graph, heat, rel_err

    from kosmos.kernels import gemm as core
    from kosmos.kernels.runtime import SimWorld

    nested = core.CONFIGS["bn256_nested"]
    dev = "cuda"
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    sims = {W: SimWorld(W) for W in (1, 8)}

    def timed(M, K, N, base: dict, fused: dict):
        """base: name -> fn over the whole GEMM; fused: (op, W) -> (fn, result-check fn). Returns rows."""
        errs = {}
        for key, (fn, check) in fused.items():
            fn()
            torch.cuda.synchronize()
            errs[key] = check()
        heat(base["core"], args.heat)
        ms = {k: [] for k in list(base) + list(fused)}
        for _ in range(args.rounds):
            for k, fn in base.items():
                ms[k].append(bench_graph(fn))
            for k, (fn, _) in fused.items():
                ms[k].append(bench_graph(fn))
        med = {k: statistics.median(v) for k, v in ms.items()}
        out = []
        for op, W in fused:
            t = med[(op, W)]
            out.append(dict(op=op, M=M, K=K, N=N, W=W, cublas_ms=med["cublas"], core_ms=med["core"],
                            core_nested_ms=med["nested"], core_ws_ms=med["ws"], fused_ms=t, fused_ms_rounds=ms[(op, W)],
                            core_ms_rounds=ms["core"], ref_ms=W * med["core"],
                            overhead_pct=100 * (t / (W * med["core"]) - 1), fused_tflops=tflops(M, K, N, t, W),
                            core_tflops=tflops(M, K, N, med["core"]), err_vs_core=errs[(op, W)]))
            print(json.dumps(out[-1]), flush=True)
        return out

    def baselines(M, K, N):
        """Random bf16 input [M, K] and Linear weight [N, K] (used as w.t()), the core's product of them, and the
        unfused candidates: cuBLAS, the GEMM core's Triton tile loop (what the fused kernels reuse, so the queue
        overhead is measured against it), the same with a nested tile loop, and gemm()'s default (the
        warp-specialized kernel on sm_90)."""
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16)
        core_out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        nested_out = torch.empty_like(core_out)
        cublas_out = torch.empty_like(core_out)
        ws_out = torch.empty_like(core_out)
        tiled = core.select_config(M, N, K, torch.bfloat16)
        core.gemm(x, w.t(), out=core_out, config=tiled)
        base = dict(cublas=lambda: torch.mm(x, w.t(), out=cublas_out),
                    core=lambda: core.gemm(x, w.t(), out=core_out, config=tiled),
                    nested=lambda: core.gemm(x, w.t(), out=nested_out, config=nested),
                    ws=lambda: core.gemm(x, w.t(), out=ws_out))
        return x, w, core_out, base

    for (M, K, N) in AG_SHAPES:
        a, w, core_out, base = baselines(M, K, N)
        fused = {}
        for W, sw in sims.items():
            aw = a.view(W, M // W, K)
            ww = w.t().unsqueeze(0).expand(W, K, N)  # one weight for every simulated rank (rank stride 0)
            for op, with_g in (("ag_gemm", True), ("ag/nogath", False)):
                outs = [torch.full((W, M, N), float("nan"), device=dev, dtype=torch.bfloat16)]
                gath = torch.full((W, M, K), float("nan"), device=dev, dtype=torch.bfloat16) if with_g else None

                def run(sw=sw, aw=aw, ww=ww, outs=outs, gath=gath):
                    sw.ag_gemm(aw, [ww], None, outs=outs, gathered=gath)

                def check(W=W, outs=outs, gath=gath):
                    e = max(rel_err(outs[0][r], core_out) for r in range(W))
                    if gath is not None and not all(torch.equal(gath[r], a) for r in range(W)):
                        return float("nan")  # a wrong gathered buffer shows as NaN error
                    return e
                fused[(op, W)] = (run, check)
        rows += timed(M, K, N, base, fused)
    for (M, K, N) in RS_SHAPES:
        x, w, core_out, base = baselines(M, K, N)
        fused = {}
        for W, sw in sims.items():
            xw = x.unsqueeze(0).expand(W, M, K)  # every simulated rank multiplies the same [M, K] (rank stride 0)
            ww = w.t().unsqueeze(0).expand(W, K, N)
            out = torch.full((W, M // W, N), float("nan"), device=dev, dtype=torch.bfloat16)

            def run(sw=sw, xw=xw, ww=ww, out=out):
                sw.gemm_rs([xw], [ww], None, "avg", out=out)

            def check(out=out):
                return rel_err(out.reshape(M, N), core_out)  # avg of W equal partials == one partial
            fused[("gemm_rs", W)] = (run, check)
        rows += timed(M, K, N, base, fused)
    return rows


def print_queue_table(rows):
    print("\nqueue overhead on one GPU: fused (all comm tasks run) vs GEMM core x W, bf16, device ms (CUDA-graph "
          "replays, L2 flushed), median over rounds")
    print("(nested = the core with its tile loop not flattened, as in a claim loop; ovh% is against W*core;"
          " ag/nogath = AG+GEMM without the gathered buffer returned)")
    print(f"{'op':9} {'M':>6} {'K':>6} {'N':>6} {'W':>2} {'cublas':>7} {'core':>7} {'nested':>7} {'W*core':>8} "
          f"{'fused':>8} {'ovh%':>6} {'TF/s':>5} {'err':>7}")
    for r in rows:
        print(f"{r['op']:9} {r['M']:6d} {r['K']:6d} {r['N']:6d} {r['W']:2d} {r['cublas_ms']:7.3f} {r['core_ms']:7.3f} "
              f"{r['core_nested_ms']:7.3f} {r['ref_ms']:8.3f} {r['fused_ms']:8.3f} {r['overhead_pct']:6.1f} "
              f"{r['fused_tflops']:5.0f} {r['err_vs_core']:7.1e}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["queue", "dist"], default="queue")
    p.add_argument("--out", default=None, help="JSON with every number")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds per shape, every method once per round (median)")
    p.add_argument("--heat", type=float, default=2.0, help="s of GEMMs before a shape's first timing")
    dist_args = p.add_argument_group("dist mode (benchmarks/tp_sp_dist.py)")
    dist_args.add_argument("--shapes", choices=["small", "full"], default="small",
                           help="shape grid: small (2 AG + 2 RS shapes) or full (6 + 6)")
    dist_args.add_argument("--plot", default=None, help="PNG of the speed-ups per shape (needs matplotlib)")
    dist_args.add_argument("--reps", type=int, default=10, help="timed reps per method (median)")
    dist_args.add_argument("--warmup", type=int, default=3, help="untimed calls before the reps")
    dist_args.add_argument("--inner", type=int, default=5, help="calls back to back per rep")
    dist_args.add_argument("--time-limit", type=float, default=0, help="s; a rank still running then dumps its "
                           "stacks and exits (0: none)")
    dist_args.add_argument("--spin-timeout", type=float, default=30.0, help="s; bound of the fused kernels' spins")
    args = p.parse_args()
    if args.mode == "queue":
        rows = queue_mode(args)
        print_queue_table(rows)
        if args.out and rows:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
        return
    import tp_sp_dist

    rows = tp_sp_dist.run(args)
    if rows:  # rank 0
        if args.plot:
            print(tp_sp_dist.plot(rows, args.plot))
        print("\n" + tp_sp_dist.table(rows))


if __name__ == "__main__":
    main()
