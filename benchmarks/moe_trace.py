"""Where the fused MoE forward's time goes inside its one launch: every task's claim, wait and finish times
(%globaltimer, moe_forward(trace=...)) summed per task kind and over the launch's timeline.

    PYTHONPATH=. python3 benchmarks/moe_trace.py --layers qwen3_235b,deepseek_v3 --T 16384 --json trace.json

Per kind (ROUTE, SCAN, SCATTER, UP, DOWN, FOLD): tasks, SM-time spent waiting (claimed -> wait over) and working
(wait over -> done) in SM-ms (summed over programs), mean work per task, first claim and last finish from the
launch's first claim. Then the timeline in --bins slices: the share of the programs' time working on each kind,
waiting, and outside any task (between a finish and the next claim, or after a program's last task). The traced
build stores 4 words a task; its time is printed beside the plain kernel's (measure.bench_calls median: 10+ calls,
L2 flushed) to show what the trace costs. --variants "default;bt=64" traces each layer
once per variant: MoeConfig fields replaced on forward_configs' first config ("default": that config itself).
DeepSeek-V3 runs its real router (sigmoid, 8 groups / top-4 groups, correction bias, scaling 2.5, fp32 router).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from measure import bench_calls
from moe import LAYERS

from kosmos.kernels.moe import KINDS, TaskLayout


def layer_inputs(layer: str, T: int, device="cuda", dtype=torch.bfloat16):
    d = LAYERS[layer]
    H, I, E, k = d["H"], d["I"], d["E"], d["k"]
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    gu = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) / H**0.5
    down = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) / I**0.5
    if d["family"] == "deepseek_v3":
        rw = torch.randn(E, H, device=device, dtype=torch.float32, generator=g) / H**0.5
        corr = torch.randn(E, device=device, dtype=torch.float32, generator=g) * 0.01
        kw = dict(scoring="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                  router_dtype=torch.float32)
        return (hidden, rw, None, corr, gu, down, k), kw
    rw = torch.randn(E, H, device=device, dtype=dtype, generator=g) / H**0.5
    kw = dict(scoring="softmax", norm_topk_prob=True)
    if d["family"] == "mixtral":  # its routing weights stay fp32 on bf16
        kw["weights_dtype"] = torch.float32
    return (hidden, rw, None, None, gu, down, k), kw


def config_variant(base, variant: str):
    """'default' (base itself) or 'field=value,...' (MoeConfig fields replaced; ints, bools as 0 / 1)."""
    if variant == "default":
        return base
    fields = dict(kv.split("=") for kv in variant.split(","))
    return dataclasses.replace(base, **{f: type(getattr(base, f))(int(v)) for f, v in fields.items()})


def task_kinds(T, H, I, E, k, cfg) -> torch.Tensor:
    """The kind (index into KINDS) of every task of the launch (moe.TaskLayout: with fold_groups > 1 the DOWN and
    FOLD tasks interleave)."""
    lay = TaskLayout.of(T, H, I, E, k, cfg)
    return torch.tensor([lay.kind_of(t)[0] for t in range(lay.num_tasks)])


def summarize(trace: torch.Tensor, kinds_of: torch.Tensor, programs: int, bins: int) -> dict:
    tr = trace.cpu().double()
    t0 = tr[:, 0].min()
    claim, waited, done = tr[:, 0] - t0, tr[:, 1] - t0, tr[:, 2] - t0
    span = float(done.max())
    kinds = {}
    for i, name in enumerate(KINDS):
        sl = kinds_of == i
        if not sl.any():  # a kind this launch does not have (RGEMM without router_gemm)
            kinds[name] = dict(tasks=0, wait_sm_ms=0.0, work_sm_ms=0.0, mean_work_us=float("nan"),
                               first_us=float("nan"), last_us=float("nan"))
            continue
        wait = (waited[sl] - claim[sl]).clamp_min(0)
        work = (done[sl] - waited[sl]).clamp_min(0)
        kinds[name] = dict(tasks=int(sl.sum()), wait_sm_ms=float(wait.sum()) / 1e6,
                           work_sm_ms=float(work.sum()) / 1e6, mean_work_us=float(work.mean()) / 1e3,
                           first_us=float(claim[sl].min()) / 1e3, last_us=float(done[sl].max()) / 1e3)
    # timeline: per bin, the SM-time of each kind's work, of every wait, and outside tasks
    edges_t = torch.linspace(0, span, bins + 1, dtype=torch.float64)
    lo, hi = edges_t[:-1], edges_t[1:]

    def overlap(a, b):  # [tasks] intervals -> [bins] summed overlap in ns
        return (torch.minimum(b[:, None], hi[None, :]) - torch.maximum(a[:, None], lo[None, :])).clamp_min(0).sum(0)

    timeline = []
    per_kind = {}
    for i, name in enumerate(KINDS):
        sl = kinds_of == i
        per_kind[name] = overlap(waited[sl], done[sl])
    waits = overlap(claim, waited)
    cap = (hi - lo) * programs
    for b in range(bins):
        row = {name: float(per_kind[name][b] / cap[b]) for name in KINDS}
        row["wait"] = float(waits[b] / cap[b])
        row["outside"] = max(0.0, 1.0 - sum(row.values()))
        timeline.append(row)
    busy = sum(k["work_sm_ms"] for k in kinds.values())
    return dict(span_us=span / 1e3, programs=programs, busy_share=busy * 1e6 / (span * programs), kinds=kinds,
                timeline=timeline)


def main(argv=None) -> int:
    from kosmos.kernels import moe, runtime

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="qwen3_235b,deepseek_v3")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--bins", type=int, default=20)
    p.add_argument("--json", default="")
    p.add_argument("--variants", default="default", help="';'-separated variants, each 'default' or field=value,...")
    args = p.parse_args(argv)
    results = []
    runs = [(layer, variant) for layer in args.layers.split(",") for variant in args.variants.split(";")]
    for layer, variant in runs:
        (hidden, rw, rb, corr, gu, down, k), kw = layer_inputs(layer, args.T)
        T, H = hidden.shape
        E, two_i, _ = gu.shape
        cfg = moe.forward_configs(hidden, gu, k)[0]
        cfg = moe.resolve_router_gemm(config_variant(cfg, variant), kw.get("router_dtype") or hidden.dtype,
                                      hidden.dtype)
        kinds_of = task_kinds(T, H, two_i // 2, E, k, cfg)
        trace = torch.zeros(len(kinds_of), 4, dtype=torch.int64, device="cuda")

        def plain():
            return moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw, config=cfg)

        def traced():
            return moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw, config=cfg, trace=trace)

        assert all(torch.equal(a, b) for a, b in zip(plain(), traced())), "the trace changed the results"
        ms_plain = bench_calls(plain, 100, 300)
        ms_traced = bench_calls(traced, 100, 300)
        traced()
        torch.cuda.synchronize()
        res = summarize(trace, kinds_of, runtime.num_sms(hidden.device), args.bins)
        res.update(layer=layer, T=T, config=str(cfg), ms_plain=ms_plain, ms_traced=ms_traced)
        results.append(res)
        print(f"\n## {layer} T={T} {variant}: kernel {ms_plain:.3f} ms (traced build {ms_traced:.3f}); traced span "
              f"{res['span_us'] / 1e3:.3f} ms on {res['programs']} programs, {100 * res['busy_share']:.1f}% of "
              f"SM-time in task work")
        print(f"{'kind':8} {'tasks':>7} {'wait SM-ms':>11} {'work SM-ms':>11} {'us/task':>8} {'first us':>9} "
              f"{'last us':>9}")
        for name, kd in res["kinds"].items():
            print(f"{name:8} {kd['tasks']:7d} {kd['wait_sm_ms']:11.2f} {kd['work_sm_ms']:11.2f} "
                  f"{kd['mean_work_us']:8.2f} {kd['first_us']:9.1f} {kd['last_us']:9.1f}")
        print("timeline (% of SM-time per slice): " + " ".join(f"{n[:4]:>5}" for n in KINDS + ("wait", "outside")))
        for b, row in enumerate(res["timeline"]):
            t_hi = res["span_us"] * (b + 1) / args.bins
            print(f"  to {t_hi:8.1f} us: " + " ".join(f"{100 * row[n]:5.1f}" for n in KINDS + ("wait", "outside")))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
