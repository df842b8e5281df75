"""MoE benchmark, EP mode on several GPUs (`benchmarks/moe_ep.py --dist` under torchrun; one process per GPU, NCCL).

    torchrun --nproc-per-node 2 benchmarks/moe_ep.py --dist --layers qwen3_30b_a3b,qwen3_235b,deepseek_v3 \
        --tokens 4096,16384 --json ep_dist.json --plot ep_dist.png
    torchrun --nproc-per-node 2 benchmarks/moe_ep.py --dist --tiny        # CPU (gloo) smoke run of the script

Each rank holds T tokens of its own and E/N of the layer's E experts (rank r: [r*E/N, (r+1)*E/N)); random weights
and router (routing roughly balanced); DeepSeek-V3: group-limited sigmoid router in fp32 with a correction bias, as
HF's (its shared expert is not part of the timed layer). Variants, bf16:
  fused      kosmos::moe_layer with the EP group under KOSMOS_FUSED_MOE=forward: the fused EP forward kernel; fwd+bwd
             adds the op's reference EP backward (the default pairing)
  fused_bwd  KOSMOS_FUSED_MOE=1: fwd+bwd with the fused EP backward kernel as well
  kernel     the fused EP forward launcher alone (kosmos.kernels.moe_ep_group): fused - kernel = the op's per-call
             group check (one all_reduce and a host read)
  reference  kosmos::moe_layer's own reference impl (KOSMOS_FUSED_MOE=0): counts exchanged and read on the host,
             all_to_all_single dispatch / combine, grouped matmuls; its backward is the op's registered one, which
             recomputes the up projection and dispatches again
  unfused    the standard path written with autograd (torchtitan, HF AllToAllEP): router, counts exchanged by
             all_to_all_single and read on the host, all_to_all_single dispatch, torch._grouped_mm experts,
             all_to_all_single combine, weighted fold; fwd+bwd by autograd on saved activations
  dense      the FLOP bound: one bf16 GEMM [T*k, H] x [H, 3I] (the routed experts' FLOPs per rank); fwd+bwd = 3x
Times: CUDA events around each call after the ranks met at a barrier; the median over the reps after warm-up, then
the max over ranks. speedup = unfused / variant; "x dense" = variant / dense. a2a: the unfused forward's dispatch and
combine, bytes this rank sends to other ranks (max over ranks), their event-timed duration (each up to the first
use of the received rows) and GB/s. Peak: max_memory_allocated of one fwd+bwd step above what was allocated before
it; the fused EP kernels' symmetric workspace (not in the caching allocator) is listed apart ("ws"). Correctness on
the first call of each cell: fused (fwd+bwd with fused_bwd when selected) against unfused, rel err of the output and
of every gradient; "rows>5%" counts output rows off by more than 5 % (a bf16 routing near-tie moves a row to another
expert). The JSON is rewritten after every cell, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from measure import speedup_plot
from moe_ep import LAYERS

from kosmos.kernels.moe_ops import fused_env

VARIANTS = ("fused", "fused_bwd", "kernel", "reference", "unfused", "dense")
TINY = dict(H=64, I=32, E=8, k=2)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rows_off(a, b, tol: float = 0.05) -> int:
    a, b = a.detach().double(), b.detach().double()
    return int(((a - b).norm(dim=-1) > tol * b.norm(dim=-1).clamp_min(1e-30)).sum())


# ------------------------------------------------------------------------------------------------ the layer


class Cell:
    """One rank's inputs of a (layer, T) cell and the calls of every variant."""

    def __init__(self, layer: str, T: int, device, group, tiny: bool):
        d = dict(LAYERS[layer], **(TINY if tiny else {}))
        self.layer, self.T, self.device, self.group = layer, T, device, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.H, self.I, self.E, self.k = d["H"], d["I"], d["E"], d["k"]
        self.E_loc = self.E // self.world
        sigmoid = d.get("scoring") == "sigmoid"
        n_group, topk_group = d.get("n_group", 1), d.get("topk_group", 1)
        if tiny and n_group > 1:
            n_group, topk_group = 2, 1
        self.router = dict(scoring=d.get("scoring", "softmax"), norm_topk_prob=True, n_group=n_group,
                           topk_group=topk_group, routed_scaling_factor=d.get("rsf", 1.0),
                           router_dtype=torch.float32 if sigmoid else None)

        def randn(*shape, seed, scale=1.0):  # generated in bf16 on the device: no fp32 copy of the experts
            g = torch.Generator(device=device).manual_seed(seed)
            return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16).mul_(scale)

        # the router is replicated (the same seed on every rank); experts and tokens are this rank's
        rw = randn(self.E, self.H, seed=0, scale=self.H ** -0.5)
        gu = randn(self.E_loc, 2 * self.I, self.H, seed=100 + self.rank, scale=self.H ** -0.5)
        dn = randn(self.E_loc, self.H, self.I, seed=200 + self.rank, scale=self.I ** -0.5)
        x = randn(T, self.H, seed=300 + self.rank)
        self.grad = randn(T, self.H, seed=400 + self.rank)
        self.corr = randn(self.E, seed=1, scale=0.01).float() if sigmoid else None
        self.params = [t.requires_grad_() for t in (x, rw, gu, dn)]
        self.probe: list = []  # (events or times) of the unfused dispatch / combine
        self.a2a_bytes = 0

    def op(self, **kw):
        x, rw, gu, dn = self.params
        r = self.router
        return torch.ops.kosmos.moe_layer(x, rw, None, self.corr, gu, dn, self.k, r["scoring"], r["norm_topk_prob"],
                                          r["n_group"], r["topk_group"], r["routed_scaling_factor"],
                                          r["router_dtype"], "silu", False, self.group.group_name, self.world)[0]

    def kernel(self):
        from kosmos.kernels.moe_ep_group import moe_ep_forward_group

        x, rw, gu, dn = self.params
        r = self.router
        return moe_ep_forward_group(x, rw, None, self.corr, gu, dn, self.k, r["scoring"], r["norm_topk_prob"],
                                    r["n_group"], r["topk_group"], r["routed_scaling_factor"], r["router_dtype"],
                                    "silu", False, self.group.group_name)[0]

    def unfused(self, probe: bool = False):
        """The standard EP MoE layer in autograd ops (module docstring); probe: time the two all_to_alls."""
        from kosmos.ops.moe_math import route

        x, rw, gu, dn = self.params
        W, E_loc, k = self.world, self.E_loc, self.k
        r = self.router
        _, ids, weights = route(x, rw, None, self.corr, k, r["scoring"], True, r["n_group"], r["topk_group"],
                                r["routed_scaling_factor"], r["router_dtype"])
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E)
        recv_counts = funcol.all_to_all_single(counts, None, None, self.group).view(W, E_loc)
        send = counts.view(W, E_loc).sum(1).tolist()  # the host sync: split sizes are host ints
        recv = recv_counts.sum(1).tolist()
        mark = self._mark if probe else (lambda: None)
        mark()
        received = funcol.all_to_all_single_autograd(x[order // k], recv, send, self.group)
        local = torch.arange(E_loc, device=x.device).repeat(W).repeat_interleave(recv_counts.reshape(-1),
                                                                                 output_size=sum(recv))
        perm = torch.argsort(local, stable=True)
        rows = received[perm]
        mark()
        offs = torch.cumsum(recv_counts.sum(0), 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(rows, gu.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, dn.transpose(-2, -1), offs=offs)
        mark()
        back = funcol.all_to_all_single_autograd(y[torch.argsort(perm)], send, recv, self.group)
        slots = back[torch.argsort(order)].view(self.T, k, self.H)
        mark()
        if probe:
            self.a2a_bytes = (sum(send) - send[self.rank] + sum(recv) - recv[self.rank]) * self.H * y.element_size()
        return (slots.float() * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)

    def _mark(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.probe.append(ev)
        else:
            self.probe.append(time.perf_counter())

    def a2a_ms(self, reps: int) -> float:
        """Median over the last `reps` probed calls of dispatch + combine (ms)."""
        marks = self.probe[-4 * reps:]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            span = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            span = lambda a, b: (b - a) * 1e3  # noqa: E731
        return statistics.median(span(m[0], m[1]) + span(m[2], m[3]) for m in zip(*[iter(marks)] * 4))

    def step(self, fn):
        """fwd+bwd of fn: the gradients of sum(out * grad) w.r.t. the tokens and every weight."""
        return torch.autograd.grad(fn(), self.params, self.grad)


# ------------------------------------------------------------------------------------------------ timing


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup: int, rep: int) -> float:
    """Median ms of fn over rep calls after warmup ones, each started after a barrier; the max over ranks."""
    for _ in range(warmup):
        fn()
    spans = []
    for _ in range(rep):
        dist.barrier()
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            spans.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            spans.append((t0, time.perf_counter()))
    _sync(device)
    ms = statistics.median(s.elapsed_time(e) if device.type == "cuda" else (e - s) * 1e3 for s, e in spans)
    return _max_over_ranks(ms, device)


def _max_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def peak_gib(step, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return _max_over_ranks((torch.cuda.max_memory_allocated(device) - base) / 2**30, device)


def estimate_gib(c: Cell) -> float:
    """A rough upper bound of one rank's memory in the cell: weights and their gradients, the fused backward's
    workspace (grown by up to 1.5x) and temporaries, or the unfused path's saved activations, whichever is larger."""
    rows, H, I = c.world * c.T * c.k, c.H, c.I
    weights = 2 * (c.E_loc * 3 * H * I * 2)  # bf16 experts and their gradients
    fused = 1.5 * (rows * H * 4 + c.T * c.k * H * 2) + rows * (2 * I + I + H) * 2
    unfused = c.T * c.k * (6 * H * 2 + H * 4 + 3 * I * 2) * 1.5
    return (weights + max(fused, unfused)) / 2**30


def run_cell(c: Cell, variants, warmup: int, rep: int) -> dict:
    import kosmos
    from kosmos.kernels import runtime

    dev = c.device
    flops = 2 * c.T * c.k * 3 * c.H * c.I
    res = {"layer": c.layer, "T": c.T, "W": c.world, "H": c.H, "I": c.I, "E": c.E, "k": c.k,
           "tflop_fwd_per_rank": flops / 1e12, "est_gib": estimate_gib(c)}

    # correctness: the first call of each path
    fused_mode = "1" if "fused_bwd" in variants else "forward"
    with fused_env(fused_mode):
        with torch.no_grad():
            out_f = c.op()
        grads_f = c.step(c.op)
    with torch.no_grad():
        out_u = c.unfused()
    grads_u = c.step(c.unfused)
    errs = {"out": rel(out_f, out_u)}
    errs.update({f"d_{n}": rel(a, b) for n, a, b in zip(("hidden", "router", "gate_up", "down"), grads_f, grads_u)})
    res["rel_err"] = {k: _max_over_ranks(v, dev) for k, v in errs.items()}
    res["rows_off"] = int(_max_over_ranks(rows_off(out_f, out_u), dev))
    del out_f, grads_f, out_u, grads_u

    with torch.no_grad():
        fwd = {"fused": ("forward", c.op), "kernel": (None, c.kernel), "reference": ("0", c.op),
               "unfused": (None, lambda: c.unfused(probe=True))}
        for name, (env, fn) in fwd.items():
            if name not in variants:
                continue
            kosmos.reset_report()
            with fused_env(env) if env else contextlib.nullcontext():
                res[f"fwd_{name}"] = timed(fn, dev, warmup, rep)
            res[f"impl_fwd_{name}"] = _impls()
    if "unfused" in variants:
        res["a2a_ms"] = _max_over_ranks(c.a2a_ms(rep), dev)
        res["a2a_mb"] = _max_over_ranks(c.a2a_bytes / 1e6, dev)
        res["a2a_gbs"] = res["a2a_mb"] / 1e3 / (res["a2a_ms"] / 1e3)
    for name, env, fn in (("fused", "forward", c.op), ("fused_bwd", "1", c.op), ("reference", "0", c.op),
                          ("unfused", None, c.unfused)):
        if name not in variants:
            continue
        kosmos.reset_report()
        with fused_env(env) if env else contextlib.nullcontext():
            res[f"fwdbwd_{name}"] = timed(lambda: c.step(fn), dev, warmup, rep)
            res[f"peak_gib_{name}"] = peak_gib(lambda: c.step(fn), dev)
        res[f"impl_fwdbwd_{name}"] = _impls()
    if "dense" in variants:
        a = torch.randn(c.T * c.k, c.H, device=dev, dtype=torch.bfloat16)
        b = torch.randn(c.H, 3 * c.I, device=dev, dtype=torch.bfloat16)
        res["fwd_dense"] = timed(lambda: a @ b, dev, warmup, rep)
        res["fwdbwd_dense"] = 3 * res["fwd_dense"]
        del a, b
    if dev.type == "cuda" and any(v.startswith("fused") or v == "kernel" for v in variants):
        ws = runtime.group_workspace(c.group.group_name, dev)
        res["ws_gib"] = ws.nbytes / 2**30
        ws.check()
    for kind in ("fwd", "fwdbwd"):
        base = res.get(f"{kind}_unfused")
        for name in VARIANTS:
            t = res.get(f"{kind}_{name}")
            if t is not None and base:
                res[f"speedup_{kind}_{name}"] = base / t
            if t is not None and res.get(f"{kind}_dense"):
                res[f"x_dense_{kind}_{name}"] = t / res[f"{kind}_dense"]
    return res


def _impls() -> list:
    import kosmos

    return sorted(f"{op}: {impl} ({why})" for (op, impl, why), _ in kosmos.report().runtime.items()
                  if op.startswith("moe_layer"))


# ------------------------------------------------------------------------------------------------ output


def table(rows) -> str:
    f = lambda r, key: f"{r[key]:8.2f}" if isinstance(r.get(key), float) else f"{'-':>8}"  # noqa: E731
    head = (f"{'layer':<14} {'T':>6} {'W':>2} | fwd ms: {'fused':>8} {'kernel':>8} {'ref':>8} {'unfused':>8} "
            f"{'dense':>8} | fwd+bwd ms: {'fused':>8} {'fus_bwd':>8} {'ref':>8} {'unfused':>8} {'dense':>8} | "
            f"speedup fwd / f+b | x dense fwd / f+b | a2a MB  ms   GB/s | peak GiB fused / unfused + ws | rel err")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layer']:<14} {r['T']:>6} {r.get('W', '?'):>2} | {r['error'][:150]}")
            continue
        fb = max((r.get(f"speedup_fwdbwd_{n}", 0.0), n) for n in ("fused", "fused_bwd"))
        err = max(r["rel_err"].values())
        lines.append(
            f"{r['layer']:<14} {r['T']:>6} {r['W']:>2} | fwd ms: " + " ".join(f(r, f"fwd_{n}") for n in
                                                                             ("fused", "kernel", "reference", "unfused",
                                                                              "dense"))
            + " | fwd+bwd ms: " + " ".join(f(r, f"fwdbwd_{n}") for n in ("fused", "fused_bwd", "reference",
                                                                        "unfused", "dense"))
            + f" | {r.get('speedup_fwd_fused', float('nan')):5.2f} / {fb[0]:5.2f} ({fb[1]})"
            + f" | {r.get('x_dense_fwd_fused', float('nan')):5.2f} / {r.get('x_dense_fwdbwd_fused', float('nan')):5.2f}"
            + f" | {r.get('a2a_mb', float('nan')):6.0f} {r.get('a2a_ms', float('nan')):5.2f} "
              f"{r.get('a2a_gbs', float('nan')):6.1f}"
            + f" | {r.get('peak_gib_fused', float('nan')):5.2f} / {r.get('peak_gib_unfused', float('nan')):5.2f} + "
              f"{r.get('ws_gib', float('nan')):5.2f}"
            + f" | {err:.1e} rows>5%: {r['rows_off']}")
    impls = sorted({i for r in rows for k, v in r.items() if k.startswith("impl_") for i in v})
    lines.append("impls that ran: " + "; ".join(impls)[:1500])
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print(f"no matplotlib: {path} not written")
        return
    rows = [r for r in rows if "error" not in r]
    curves = {}
    for kind in ("fwd", "fwdbwd"):
        curves[kind] = {}
        for name in ("fused", "fused_bwd", "kernel", "reference", "dense"):
            ys = [r.get(f"speedup_{kind}_{name}") for r in rows]
            if any(y is not None for y in ys):
                curves[kind][name] = [y if y is not None else float("nan") for y in ys]
    speedup_plot(path, [f"{r['layer']}\nT={r['T']} W={r['W']}" for r in rows], curves, "the unfused all_to_all path")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dist", action="store_true", help="(this mode)")
    p.add_argument("--layers", default="qwen3_30b_a3b,qwen3_235b,deepseek_v3")
    p.add_argument("--tokens", default="4096,16384", help="tokens per rank")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rep", type=int, default=10)
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="")
    p.add_argument("--spin-timeout", type=float, default=60.0, help="seconds (runtime.set_spin_timeout)")
    p.add_argument("--tiny", action="store_true", help="CPU over gloo, tiny dims, no kernel: checks the script runs")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = set(variants) - set(VARIANTS)
    if bad:
        p.error(f"unknown variants {sorted(bad)}; choose from {VARIANTS}")
    bad = set(args.layers.split(",")) - set(LAYERS)
    if bad:
        p.error(f"unknown layers {sorted(bad)}; choose from {sorted(LAYERS)}")
    import datetime
    import importlib

    from kosmos.kernels import runtime

    importlib.import_module("kosmos")  # registers the ops and the fused impls

    # NVLink multicast stays off (it can take a host's GPUs out of service)
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

    if args.tiny:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        device = torch.device("cpu")
        variants = [v for v in variants if v != "kernel"]
    else:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=device)
    runtime.set_spin_timeout(args.spin_timeout)
    group = dist.group.WORLD
    rank = dist.get_rank()
    rows = []
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    for layer in args.layers.split(","):
        for T in tokens:
            t0 = time.monotonic()
            try:
                cell = Cell(layer, T, device, group, args.tiny)
                free = torch.cuda.mem_get_info(device)[0] / 2**30 if device.type == "cuda" else float("inf")
                if estimate_gib(cell) > 0.9 * free:
                    row = {"layer": layer, "T": T, "W": cell.world,
                           "error": f"skipped: ~{estimate_gib(cell):.0f} GiB estimated, {free:.0f} GiB free"}
                else:
                    row = run_cell(cell, variants, 1 if args.tiny else args.warmup, 1 if args.tiny else args.rep)
                del cell
            except Exception as e:  # noqa: BLE001  (recorded; the other cells still run if the ranks are in step)
                row = {"layer": layer, "T": T, "error": f"{type(e).__name__}: {e}"}
            row["seconds"] = time.monotonic() - t0
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                   "torch": torch.__version__, "world": dist.get_world_size(), "rows": rows}, f,
                                  indent=1)
    if rank == 0:
        if args.plot:
            plot(rows, args.plot)
        print(table(rows), flush=True)
    dist.destroy_process_group()
    return 0
