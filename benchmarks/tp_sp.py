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


def bench(fn, warmup_ms=25, rep_ms=200) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def tflops(M, K, N, ms, copies=1) -> float:
    return 2.0 * M * K * N * copies / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------------------------ queue mode


def queue_mode(args) -> list[dict]:
    from kosmos.kernels import gemm as core
    from kosmos.kernels.runtime import SimWorld

    # the core without its flattened tile loop: the loop structure a claim loop has
    nested = getattr(core, "CONFIGS", {}).get("bn256_nested")

    def gemm(a, b, out, config=None):
        return core.gemm(a, b, out=out, **({"config": config} if config is not None else {}))

    def timed_core(a, b, out, config=None):
        """Median ms of the GEMM core (NaN if the core cannot run this; then cuBLAS stands in for W*core)."""
        try:
            gemm(a, b, out, config)
            return bench(lambda: gemm(a, b, out, config))
        except Exception as e:  # noqa: BLE001  (the core is another module; report, do not die)
            print(f"GEMM core failed ({type(e).__name__}: {str(e)[:200]}); cuBLAS stands in", flush=True)
            if config is not None:
                return float("nan")
            torch.mm(a, b, out=out)
            return bench(lambda: torch.mm(a, b, out=out))

    dev = "cuda"
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    sims = {W: SimWorld(W) for W in (1, 8)}
    for (M, K, N) in AG_SHAPES:
        a = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16)  # Linear weight, used as w.t()
        core_out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        t_nested = timed_core(a, w.t(), core_out, nested) if nested is not None else float("nan")
        t_cublas = bench(lambda: torch.mm(a, w.t(), out=core_out))
        t_core = timed_core(a, w.t(), core_out)  # last: core_out holds the core's product for err_vs_core
        for (W, sw), epi in [(item, e) for item in sims.items() for e in ("tma", "store")]:
            aw = a.view(W, M // W, K)
            ww = w.t().unsqueeze(0).expand(W, K, N)  # one weight for every simulated rank (rank stride 0)
            outs = [torch.empty(W, M, N, device=dev, dtype=torch.bfloat16)]
            gath = torch.empty(W, M, K, device=dev, dtype=torch.bfloat16)
            run = lambda: sw.ag_gemm(aw, [ww], None, outs=outs, gathered=gath, epilogue=epi)  # noqa: E731
            run()
            torch.cuda.synchronize()
            err = max(rel_err(outs[0][r], core_out) for r in range(W))
            t = bench(run)
            rows.append(dict(op="ag_gemm" if epi == "tma" else "ag/store", M=M, K=K, N=N, W=W, core_ms=t_core, core_nested_ms=t_nested, cublas_ms=t_cublas, fused_ms=t,
                             ref_ms=W * t_core, overhead_pct=100 * (t / (W * t_core) - 1),
                             fused_tflops=tflops(M, K, N, t, W), core_tflops=tflops(M, K, N, t_core), err_vs_core=err))
            print(json.dumps(rows[-1]), flush=True)
    for (M, K, N) in RS_SHAPES:
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=dev, generator=g).to(torch.bfloat16)
        core_out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        t_nested = timed_core(x, w.t(), core_out, nested) if nested is not None else float("nan")
        t_cublas = bench(lambda: torch.mm(x, w.t(), out=core_out))
        t_core = timed_core(x, w.t(), core_out)
        for W, sw in sims.items():
            xw = x.unsqueeze(0).expand(W, M, K)  # every simulated rank multiplies the same [M, K] (rank stride 0)
            ww = w.t().unsqueeze(0).expand(W, K, N)
            out = torch.empty(W, M // W, N, device=dev, dtype=torch.bfloat16)
            run = lambda: sw.gemm_rs([xw], [ww], None, "avg", out=out)  # noqa: E731
            run()
            torch.cuda.synchronize()
            err = rel_err(out.reshape(M, N), core_out)  # avg of W equal partials == one partial
            t = bench(run)
            rows.append(dict(op="gemm_rs", M=M, K=K, N=N, W=W, core_ms=t_core, core_nested_ms=t_nested, cublas_ms=t_cublas, fused_ms=t,
                             ref_ms=W * t_core, overhead_pct=100 * (t / (W * t_core) - 1),
                             fused_tflops=tflops(M, K, N, t, W), core_tflops=tflops(M, K, N, t_core), err_vs_core=err))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def print_queue_table(rows):
    print("\nqueue overhead on one GPU: fused (all comm tasks run) vs GEMM core x W, bf16, median ms")
    print("(nested = the core with its tile loop not flattened, as in a claim loop; ovh% is against W*core)")
    print(f"{'op':8} {'M':>6} {'K':>6} {'N':>6} {'W':>2} {'cublas':>7} {'core':>7} {'nested':>7} {'W*core':>8} "
          f"{'fused':>8} {'ovh%':>6} {'TF/s':>5} {'err':>7}")
    for r in rows:
        print(f"{r['op']:8} {r['M']:6d} {r['K']:6d} {r['N']:6d} {r['W']:2d} {r['cublas_ms']:7.3f} {r['core_ms']:7.3f} "
              f"{r['core_nested_ms']:7.3f} {r['ref_ms']:8.3f} {r['fused_ms']:8.3f} {r['overhead_pct']:6.1f} "
              f"{r['fused_tflops']:5.0f} {r['err_vs_core']:7.1e}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["queue", "dist"], default="queue")
    p.add_argument("--out", default=None, help="JSON with every number")
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
