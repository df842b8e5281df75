"""`benchmarks/tp_sp.py --mode dist`: the fused TP+SP ops on N GPUs of one host, against what they replace.

    torchrun --nproc-per-node N benchmarks/tp_sp.py --mode dist [--shapes small|full] [--out r.json] [--plot r.png]

Per shape (M, K, N) of the whole GEMM, bf16, each rank holding its own random shard and weight:
- AG: a [M/W, K] per rank, w [N, K] per rank; out = all_gather(a) @ w.t(), [M, N] on every rank;
- RS: x [M, K/W] per rank, w [N, K/W] per rank; out = reduce_scatter(x @ w.t()), [M/W, N] per rank.
Timed, each as the median over `rounds` rounds (every method once per round, in turn, after the GPU was heated
by 2 s of the rank's GEMM) of a median over reps after warm-up, then the max over ranks: NCCL + cuBLAS in sequence; the
GEMM alone (cuBLAS on the full gathered input for AG, on the full local input for RS); the collective alone
(NCCL all_gather / reduce_scatter); PyTorch async-TP (torch.ops.symm_mem.fused_all_gather_matmul /
fused_matmul_reduce_scatter); kosmos (torch.ops.kosmos.ag_gemm / gemm_rs). Derived: bound = max(GEMM, collective),
the time of perfect overlap; kosmos / bound; speed-up of kosmos over NCCL + cuBLAS and over async-TP. A rep times
`inner` calls back to back between two CUDA events (host launch costs overlap with the GPU work as in a model), after
a barrier. Rank 0 writes the JSON after every shape (a run cut short keeps what it measured), plots the speed-ups
(matplotlib, if installed) and prints the table last. NVLink multicast stays off (tp_sp.py sets the env).
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from measure import heat, rel_err

SHAPES = {
    "small": {"ag_gemm": [(8192, 4096, 4096), (16384, 8192, 7168)],
              "gemm_rs": [(8192, 4096, 4096), (16384, 14336, 8192)]},
    "full": {"ag_gemm": [(4096, 8192, 5120), (8192, 4096, 4096), (16384, 4096, 6144), (8192, 4096, 14336),
                         (16384, 8192, 7168), (32768, 8192, 8192)],
             "gemm_rs": [(4096, 14336, 8192), (8192, 4096, 4096), (16384, 4096, 4096), (8192, 14336, 4096),
                         (16384, 14336, 8192), (32768, 28672, 8192)]},
}
METHODS = ("nccl_cublas", "gemm", "comm", "async_tp", "kosmos")


def time_dist(fn, reps: int, warmup: int, inner: int) -> float:
    """Median over `reps` of the mean time of `inner` back-to-back calls (CUDA events), max over ranks, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / inner)
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return float(med.item())


def _impls(op: str) -> list[str]:
    import kosmos

    runs = kosmos.report().runtime
    return sorted({impl if impl == "fused" else f"{impl}: {why}" for (o, impl, why) in runs if o == op})


def _cases(op: str, M: int, K: int, N: int, W: int, group_name: str, g):
    """(callables by method, (kosmos out fn, async-TP out fn, reference out fn), why_not) of one shape."""
    from kosmos.kernels import fused_ops

    bf16 = torch.bfloat16
    if op == "ag_gemm":
        a = torch.randn(M // W, K, device="cuda", generator=g).to(bf16)
        w = torch.randn(N, K, device="cuda", generator=g).to(bf16)
        gathered = torch.empty(M, K, device="cuda", dtype=bf16)
        out = torch.empty(M, N, device="cuda", dtype=bf16)

        def nccl_cublas():
            dist.all_gather_into_tensor(gathered, a)
            return torch.mm(gathered, w.t(), out=out)

        def kosmos_op():
            return torch.ops.kosmos.ag_gemm(a, [w.t()], [None], 0, W, group_name, False, None)[0]

        def async_tp():
            return torch.ops.symm_mem.fused_all_gather_matmul(a, [w.t()], gather_dim=0, group_name=group_name)[1][0]

        fns = dict(nccl_cublas=nccl_cublas, gemm=lambda: torch.mm(gathered, w.t(), out=out),
                   comm=lambda: dist.all_gather_into_tensor(gathered, a), async_tp=async_tp, kosmos=kosmos_op)
        why = fused_ops.why_not_ag_gemm(a, [w.t()], [None], 0, W, group_name, False, None)
    else:
        x = torch.randn(M, K // W, device="cuda", generator=g).to(bf16)
        w = torch.randn(N, K // W, device="cuda", generator=g).to(bf16)
        y = torch.empty(M, N, device="cuda", dtype=bf16)
        out = torch.empty(M // W, N, device="cuda", dtype=bf16)

        def nccl_cublas():
            dist.reduce_scatter_tensor(out, torch.mm(x, w.t(), out=y))
            return out

        def kosmos_op():
            return torch.ops.kosmos.gemm_rs([x], [w.t()], None, 0, "sum", W, group_name, None)

        def async_tp():
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", scatter_dim=0, group_name=group_name)

        fns = dict(nccl_cublas=nccl_cublas, gemm=lambda: torch.mm(x, w.t(), out=y),
                   comm=lambda: dist.reduce_scatter_tensor(out, y), async_tp=async_tp, kosmos=kosmos_op)
        why = fused_ops.why_not_gemm_rs([x], [w.t()], None, 0, "sum", W, group_name, None)
    return fns, why


def measure(op: str, M: int, K: int, N: int, W: int, group_name: str, args, have_async_tp: bool) -> dict:
    import kosmos

    g = torch.Generator(device="cuda").manual_seed(1000 * M + dist.get_rank())
    fns, why = _cases(op, M, K, N, W, group_name, g)
    row = dict(op=op, M=M, K=K, N=N, W=W, kosmos_why_not=why, errors={})
    flops = 2.0 * M * K * N / (W if op == "gemm_rs" else 1)  # per rank
    # correctness first: each output against NCCL + cuBLAS (bf16 both; different summation orders)
    ref = fns["nccl_cublas"]().clone()
    for name in ("kosmos", "async_tp") if have_async_tp else ("kosmos",):
        try:
            row[f"{name}_err"] = rel_err(fns[name](), ref)
        except Exception as e:  # noqa: BLE001  (reported; timed below all the same)
            row["errors"][f"{name}_check"] = f"{type(e).__name__}: {e}"[:400]
    # rounds of every method in turn, after heating the GPU with the rank's GEMM alone (no collective: the ranks
    # may run it a different number of times), so clock drift hits every method alike
    names = [n for n in METHODS if n != "async_tp" or have_async_tp]
    heat(fns["gemm"], args.heat)
    dist.barrier()
    kosmos.reset_report()
    samples: dict = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            if name in row["errors"]:
                continue
            try:
                samples[name].append(time_dist(fns[name], args.reps, args.warmup, args.inner))
            except Exception as e:  # noqa: BLE001  (reported; the other methods still run)
                row["errors"][name] = f"{type(e).__name__}: {e}"[:400]
    for name, ms in samples.items():
        if ms and name not in row["errors"]:
            row[f"{name}_ms"] = statistics.median(ms)
            row[f"{name}_ms_rounds"] = ms
    row["kosmos_impls"] = _impls(op)
    derive(row, flops)
    return row


def derive(row: dict, flops: float) -> None:
    """bound = max(GEMM alone, collective alone), ratios and speed-ups (None where a time is missing)."""
    def ratio(num, den):
        a, b = row.get(num), row.get(den)
        return a / b if a and b else None

    g, c = row.get("gemm_ms"), row.get("comm_ms")
    row["bound_ms"] = max(g, c) if g and c else None
    row["kosmos_over_bound"] = ratio("kosmos_ms", "bound_ms")
    row["speedup_vs_nccl"] = ratio("nccl_cublas_ms", "kosmos_ms")
    row["speedup_vs_async_tp"] = ratio("async_tp_ms", "kosmos_ms")
    row["bound_speedup_vs_nccl"] = ratio("nccl_cublas_ms", "bound_ms")  # the most any overlap can gain
    k = row.get("kosmos_ms")
    row["kosmos_tflops"] = flops / (k * 1e-3) / 1e12 if k else None


def _init():
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name


def _enable_async_tp(group_name: str, rank: int) -> bool:
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group_name)  # torch < 2.13 wants it; later ones may warn
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            print(f"enable_symm_mem_for_group: {type(e).__name__}: {e}", flush=True)
    ok = hasattr(torch.ops.symm_mem, "fused_all_gather_matmul") and hasattr(torch.ops.symm_mem,
                                                                             "fused_matmul_reduce_scatter")
    if not ok and rank == 0:
        print("async-TP ops (torch.ops.symm_mem.fused_*) missing in this torch: not timed", flush=True)
    return ok


def run(args) -> list[dict]:
    """Every shape of args.shapes on this torchrun group; rows on rank 0 ([] elsewhere)."""
    if args.time_limit > 0:  # a rank still running then dumps its stacks and exits (no silent hang)
        faulthandler.dump_traceback_later(args.time_limit, exit=True)
    W, rank, group_name = _init()
    import kosmos
    from kosmos.kernels import runtime

    runtime.set_spin_timeout(args.spin_timeout)
    have_async_tp = _enable_async_tp(group_name, rank)
    rows = []
    t0 = time.perf_counter()
    for op, shapes in SHAPES[args.shapes].items():
        for (M, K, N) in shapes:
            try:
                row = measure(op, M, K, N, W, group_name, args, have_async_tp)
            except Exception as e:  # noqa: BLE001  (e.g. out of memory on every rank: the next shape may fit)
                row = dict(op=op, M=M, K=K, N=N, W=W, errors={"shape": f"{type(e).__name__}: {e}"[:400]})
                torch.cuda.empty_cache()
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
                if args.out:
                    write_json(args.out, rows, args)
    if rank == 0:
        print(f"{len(rows)} shapes in {time.perf_counter() - t0:.0f} s\n{kosmos.report()}", flush=True)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return rows if rank == 0 else []


def write_json(path: str, rows: list[dict], args) -> None:
    import triton

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                shapes=args.shapes, reps=args.reps, warmup=args.warmup, inner=args.inner, rounds=args.rounds,
                heat=args.heat)
    with open(path, "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)


def _fmt(x, spec: str, width: int, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(width)
    return (format(x, spec) + suffix).rjust(width)


def table(rows: list[dict]) -> str:
    """The dist-mode table: ms are max over ranks of each rank's median."""
    head = (f"{'op':8} {'M':>6} {'K':>6} {'N':>6} {'W':>2} {'gemm':>7} {'comm':>7} {'bound':>7} {'nccl+cb':>8} "
            f"{'asyncTP':>8} {'kosmos':>8} {'k/bound':>7} {'vs nccl':>7} {'vs aTP':>7} {'TF/s':>5} {'err':>7}  impl")
    lines = ["TP+SP: bf16, ms = max over ranks of the median; bound = max(gemm, comm); vs = speed-up of kosmos", head]
    for r in rows:
        impl = "fused" if r.get("kosmos_impls") == ["fused"] else "; ".join(r.get("kosmos_impls") or ["?"])[:60]
        lines.append(
            f"{r['op']:8} {r['M']:6d} {r['K']:6d} {r['N']:6d} {r['W']:2d} {_fmt(r.get('gemm_ms'), '.3f', 7)} "
            f"{_fmt(r.get('comm_ms'), '.3f', 7)} {_fmt(r.get('bound_ms'), '.3f', 7)} "
            f"{_fmt(r.get('nccl_cublas_ms'), '.3f', 8)} {_fmt(r.get('async_tp_ms'), '.3f', 8)} "
            f"{_fmt(r.get('kosmos_ms'), '.3f', 8)} {_fmt(r.get('kosmos_over_bound'), '.2f', 7)} "
            f"{_fmt(r.get('speedup_vs_nccl'), '.2f', 7, 'x')} {_fmt(r.get('speedup_vs_async_tp'), '.2f', 7, 'x')} "
            f"{_fmt(r.get('kosmos_tflops'), '.0f', 5)} {_fmt(r.get('kosmos_err'), '.1e', 7)}  {impl}")
        lines += [f"  {name} failed: {err[:160]}" for name, err in (r.get("errors") or {}).items()]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    """Bar chart of kosmos' speed-ups per shape (and the bound's over NCCL + cuBLAS); returns what it did."""
    try:
        import matplotlib
    except ImportError:
        return f"matplotlib not installed: no plot ({path})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{'AG' if r['op'] == 'ag_gemm' else 'RS'} {r['M']}x{r['K']}x{r['N']}" for r in rows]
    series = [("kosmos vs NCCL+cuBLAS", "speedup_vs_nccl"), ("kosmos vs async-TP", "speedup_vs_async_tp"),
              ("bound vs NCCL+cuBLAS", "bound_speedup_vs_nccl")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4))
    width = 0.8 / len(series)
    top = 1.0
    for i, (name, key) in enumerate(series):
        vals = [r.get(key) or 0.0 for r in rows]
        top = max(top, *vals)
        ax.bar([j + (i - 1) * width for j in range(len(rows))], vals, width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylim(0, 1.25 * top)  # room for the legend above the bars
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("speed-up (x)")
    W = rows[0]["W"] if rows else "?"
    ax.set_title(f"TP+SP fused collectives, bf16, {W} GPUs")
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"
