"""Persistent TMA GEMM (kosmos.kernels.gemm) against cuBLAS (torch.mm) on the TP-sharded projections of
Llama-3-70B and Qwen3-32B, M (tokens) in {4096, 8192, 16384, 32768}.

    PYTHONPATH=. python3 benchmarks/gemm.py                  # the table's config per shape
    PYTHONPATH=. python3 benchmarks/gemm.py --sweep          # candidate configs side by side (to choose the table)
    PYTHONPATH=. python3 benchmarks/gemm.py --timing eager   # Python-launched calls (launch cost included)
    PYTHONPATH=. python3 benchmarks/gemm.py --shapes moe --ms 131072 --sweep   # the MoE expert GEMMs, dense

Each shape: random inputs, correctness of every kernel against an fp32 (no TF32) reference first, then
rounds of timings (default: device time from CUDA-graph replays, L2 flushed between calls; --timing eager:
triton.testing.do_bench medians of Python-launched calls), each round timing cuBLAS then every
kernel, plus a closing cuBLAS timing; a kernel's time is the median over its rounds. Ratio = cuBLAS time /
kosmos time (> 1: faster). The spread of cuBLAS's own timings (max/min - 1) says how much is noise.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import triton

from kosmos.kernels.gemm import CONFIGS, check_operands, default_config, gemm, num_sms, plan_gemm
from measure import bench_graph, rel_err

MS = (4096, 8192, 16384, 32768)
DEFAULT_SWEEP = "table,bn256,ws128_1c,ws128_1c_ht,ws256_1c,ws256_2s"


def projection_shapes(tps=(8, 4)):
    """(label, N, K) of the QKV, O, gate+up and down projections, column-parallel QKV / gate+up (N / tp),
    row-parallel O / down (K / tp)."""
    models = [("llama70b", 8192, 64, 8, 128, 28672), ("qwen32b", 5120, 64, 8, 128, 25600)]
    shapes = []
    for name, hidden, heads, kv_heads, head_dim, inter in models:
        q, kv = heads * head_dim, 2 * kv_heads * head_dim
        for tp in tps:
            shapes += [(f"{name}.qkv.tp{tp}", (q + kv) // tp, hidden),
                       (f"{name}.o.tp{tp}", hidden, q // tp),
                       (f"{name}.gateup.tp{tp}", 2 * inter // tp, hidden),
                       (f"{name}.down.tp{tp}", hidden, inter // tp)]
    return shapes


def moe_expert_shapes():
    """(label, N, K) of the expert GEMMs of the MoE issue's layers as dense GEMMs (M = tokens x top-k rows):
    gate+up [H -> 2I] and down [I -> H] of Qwen3-30B-A3B, Qwen3-235B and DeepSeek-V3."""
    layers = [("qwen3_30b", 2048, 768), ("qwen3_235b", 4096, 1536), ("deepseek_v3", 7168, 2048)]
    return [s for name, h, i in layers for s in ((f"{name}.up", 2 * i, h), (f"{name}.down", h, i))]


def bench(fn, args):
    if args.timing == "graph":
        return bench_graph(fn)
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time every candidate config")
    p.add_argument("--configs", default=DEFAULT_SWEEP,
                   help="comma-separated candidates for --sweep: 'table' (default_config, what gemm() takes), "
                        "a CONFIGS name "
                        "(stream-K tail when plan_gemm says so), NAME+sk (stream-K forced), NAME+nosk (never)")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default="proj", choices=["proj", "moe"],
                   help="proj: the TP-sharded projections (the GEMM core's target grid); moe: the MoE layers' expert "
                        "GEMMs as dense GEMMs (pass --ms tokens x top-k, e.g. 131072)")
    p.add_argument("--only", default="", help="comma-separated substrings: shapes whose label has one of them")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--layout", default="weight", choices=["weight", "kn"],
                   help="B as w.t() of a [N, K] weight (default) or a row-major [K, N] tensor")
    p.add_argument("--timing", default="graph", choices=["graph", "eager"],
                   help="graph: device time from CUDA-graph replays (launch cost excluded, L2 flushed between "
                        "calls); eager: triton do_bench of Python-launched calls (launch cost included)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    p.add_argument("--rep", type=int, default=80, help="do_bench repetition time, ms")
    p.add_argument("--rounds", type=int, default=None,
                   help="timing rounds per shape (each times cuBLAS then every kernel); default 3, 1 with --sweep")
    p.add_argument("--json", default="", help="write all figures here")
    args = p.parse_args()
    if args.rounds is None:
        args.rounds = 1 if args.sweep else 3

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is exact
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.sweep:
        names = args.configs.split(",")
    else:
        names = ["table"]
    dev = torch.cuda.get_device_name()
    how = ("CUDA-graph replays (20 calls x 7 replays, L2 flushed, median)" if args.timing == "graph" else
           f"do_bench warmup={args.warmup}ms rep={args.rep}ms median")
    print(f"# {dev}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, B={args.layout}, "
          f"{how}, {args.rounds} rounds", flush=True)

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    t_start = time.time()
    for M in map(int, args.ms.split(",")):
        for label, N, K in (projection_shapes() if args.shapes == "proj" else moe_expert_shapes()):
            if args.only and not any(part in label for part in args.only.split(",")):
                continue
            a = torch.randn(M, K, device="cuda", dtype=dtype, generator=gen)
            if args.layout == "weight":
                b = torch.randn(N, K, device="cuda", dtype=dtype, generator=gen).t()
            else:
                b = torch.randn(K, N, device="cuda", dtype=dtype, generator=gen)
            ref = a.float() @ b.float()
            flops = 2.0 * M * N * K
            row = dict(label=label, M=M, N=N, K=K, kernels={})

            def cublas():
                return torch.mm(a, b)

            row["cublas_err"] = rel_err(cublas(), ref)
            runs = {}
            for name in names:
                base, _, mode = name.partition("+")
                cfg = default_config(a, check_operands(a, b)) if base == "table" else CONFIGS[base]
                sk = {"": None, "sk": True, "nosk": False}[mode]
                plan = plan_gemm(M, N, K, cfg, num_sms(a.device), force_stream_k=sk)
                entry = row["kernels"][name] = dict(config=cfg.name, sk_tiles=plan.sk_tiles, sk_iters=plan.sk_iters,
                                                    tiles=plan.tiles, ms_rounds=[])

                def run(cfg=cfg, sk=sk):
                    return gemm(a, b, config=cfg, stream_k=sk)

                try:  # correctness first (this also compiles)
                    out = run()
                    entry["err"] = err = rel_err(out, ref)
                    del out
                    if not err <= 1e-2:
                        entry["error"] = f"rel err {err:.3e}"
                    else:
                        runs[name] = run
                except Exception as e:  # a config that does not compile or fit: record, keep going
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            # rounds of cuBLAS, every kernel, ..., closing with cuBLAS; each figure is the median over rounds
            row["cublas_ms_rounds"] = []
            for _ in range(args.rounds):
                row["cublas_ms_rounds"].append(bench(cublas, args))
                for name, run in runs.items():
                    row["kernels"][name]["ms_rounds"].append(bench(run, args))
            row["cublas_ms_rounds"].append(bench(cublas, args))
            cub = row["cublas_ms"] = statistics.median(row["cublas_ms_rounds"])
            row["cublas_spread"] = max(row["cublas_ms_rounds"]) / min(row["cublas_ms_rounds"]) - 1
            for entry in row["kernels"].values():
                if entry["ms_rounds"]:
                    entry["ms"] = statistics.median(entry["ms_rounds"])
                    entry["ratio"] = cub / entry["ms"]
                    entry["tflops"] = flops / entry["ms"] * 1e-9
            row["cublas_tflops"] = flops / cub * 1e-9
            rows.append(row)
            del a, b, ref
            print_row(row, names, args.sweep)
            if args.json:  # after every shape, so a run cut short still leaves its figures
                dump(args, dev, rows, None)
    torch.cuda.synchronize()
    print(f"# {len(rows)} shapes in {time.time() - t_start:.0f} s", flush=True)
    summary = summarize(rows, names)
    if args.json:
        dump(args, dev, rows, summary)
    bad = [r for r in rows for n in names if "error" in r["kernels"][n] and "rel err" in r["kernels"][n]["error"]]
    sys.exit(1 if bad else 0)


def dump(args, dev, rows, summary):
    with open(args.json, "w") as f:
        json.dump(dict(device=dev, torch=torch.__version__, triton=triton.__version__, dtype=args.dtype,
                       timing=args.timing, layout=args.layout, rounds=args.rounds, warmup=args.warmup,
                       rep=args.rep, rows=rows, summary=summary), f, indent=1)


def print_row(row, names, sweep):
    shape = f"{row['label']:<20} {row['M']:>5} {row['N']:>5} {row['K']:>5}"
    noise = row["cublas_spread"]
    if sweep:
        cells = []
        for n in names:
            e = row["kernels"][n]
            cells.append((f"{e['ratio']:5.2f}" if "ratio" in e else "  ERR") + ("k" if e.get("sk_tiles") else " "))
        print(f"{shape} cub {row['cublas_tflops']:4.0f}TF {noise:.3f} | " + " ".join(cells), flush=True)
    else:
        e = row["kernels"]["table"]
        if "ratio" in e:
            print(f"{shape} {e['ms']:8.3f}ms {e['tflops']:4.0f}TF  cuBLAS {row['cublas_ms']:8.3f}ms "
                  f"{row['cublas_tflops']:4.0f}TF ({noise:.3f})  ratio {e['ratio']:.3f}  err {e['err']:.1e}  "
                  f"{e['config']}{' sk%d' % e['sk_tiles'] if e['sk_tiles'] else ''}", flush=True)
        else:
            print(f"{shape} FAILED {e.get('error')}", flush=True)


def summarize(rows, names):
    summary = {}
    print("\n# config: median / min ratio vs cuBLAS (worst shape), failures")
    if len(names) > 1:
        print("# columns: " + " ".join(f"{i}={n}" for i, n in enumerate(names)))
    for n in names:
        ratios = [(r["kernels"][n]["ratio"], r) for r in rows if "ratio" in r["kernels"][n]]
        fails = sum("ratio" not in r["kernels"][n] for r in rows)
        if not ratios:
            print(f"{n:<14} no successful runs ({rows[0]['kernels'][n].get('error') if rows else ''})")
            continue
        worst = min(ratios, key=lambda x: x[0])
        med = statistics.median(x[0] for x in ratios)
        summary[n] = dict(median=med, min=worst[0], worst=f"{worst[1]['label']} M={worst[1]['M']}", fails=fails)
        print(f"{n:<14} median {med:.3f}  min {worst[0]:.3f} ({summary[n]['worst']})  fails {fails}")
    if len(names) > 1:  # best candidate per shape: the ceiling of a per-shape table
        best = []
        for r in rows:
            ok = [(r["kernels"][n]["ratio"], n) for n in names if "ratio" in r["kernels"][n]]
            if ok:
                best.append((max(ok), r))
        if best:
            med = statistics.median(x[0][0] for x in best)
            worst = min(best, key=lambda x: x[0][0])
            summary["best_per_shape"] = dict(median=med, min=worst[0][0])
            print(f"{'best/shape':<14} median {med:.3f}  min {worst[0][0]:.3f} ({worst[1]['label']} M={worst[1]['M']})")
    noise = [r["cublas_spread"] for r in rows]
    if noise:
        print(f"# cuBLAS spread over its {len(rows[0]['cublas_ms_rounds'])} timings per shape (max/min - 1): "
              f"median {statistics.median(noise):.3f}, max {max(noise):.3f}")
    return summary


if __name__ == "__main__":
    main()
