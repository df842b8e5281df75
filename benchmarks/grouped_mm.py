"""kosmos's ragged-M grouped GEMM (kernels/grouped_ws.py) against torch._grouped_mm (CUTLASS) on the MoE layers'
expert GEMMs: the forward's up / down (Linear-style weights, K contiguous) and the backward's d_act / d_x (the
weights as stored, N contiguous), rows grouped as the reference's sorted pairs (uniform top-k routing, each group
led by a pad row).

    PYTHONPATH=. python3 benchmarks/grouped_mm.py --layers qwen3_235b,deepseek_v3 --T 16384 --rounds 3

ms are medians over the rounds of each round's median of --reps CUDA-event timed calls (the impls alternate round
by round); TF/s count 2 * rows * K * N over the grouped rows. kosmos_m: kosmos's kernel with a group's m-tiles next
to each other (grouped_mm(m_fastest=True)); kosmos_mc: the same with tiles claimed from a counter (claim=True);
kosmos_ms / kosmos_mcs: kosmos_m / kosmos_mc with each tile's rows split between two consumers (config 128x256s).
--swiglu: the up GEMM alone, kosmos_mcs against kosmos_mcs_rows (+ moe_rows.swiglu_rows) and kosmos_mcs_swiglu (its
SwiGLU epilogue, gemm_ws_host.launch_grouped_mm_swiglu: h and act in one launch); also gather_swiglu (the rows
gathered from the layer's T tokens by moe_rows.gather_rows, then kosmos_mcs_swiglu: what the reference forward runs)
and swiglu_gathered (the rows gathered inside the launch, launch_grouped_mm_swiglu(rows=...)); the rows of all of
them are that gathered copy.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

LAYERS = {"qwen3_30b_a3b": (2048, 768, 128), "qwen3_235b": (4096, 1536, 128), "deepseek_v3": (7168, 2048, 256)}


def routed_ends(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 group ends of the reference's sorted pairs: each token's k experts uniform at random, + 1 pad row each."""
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    return (ids.flatten().bincount(minlength=E) + 1).cumsum(0).to(torch.int32)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp32, a slice of the leading dim at a time (DeepSeek-V3's weight gradients are
    11 GB in bf16: whole fp32 copies do not fit beside them on an 80 GB card); 0 for two all-zero tensors."""
    diff = norm = 0.0
    for g, r in zip(got.split(8), ref.split(8)):
        diff += (g.float() - r.float()).square().sum().item()
        norm += r.float().square().sum().item()
    return (diff / max(norm, 1e-60)) ** 0.5


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def cases(H: int, I: int, E: int, S: int, dev):
    """name -> (A [S, K], B [E, K, N]) for the four expert GEMMs (weights made once, used in both layouts)."""
    gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(S, H, device=dev, dtype=torch.bfloat16)
    act = torch.randn(S, I, device=dev, dtype=torch.bfloat16)
    d_h = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16)
    return {"up (fwd, K-contig B)": (x, gate_up.transpose(1, 2)), "down (fwd, K-contig B)": (act, down.transpose(1, 2)),
            "d_act (bwd, N-contig B)": (x, down), "d_x (bwd, N-contig B)": (d_h, gate_up)}


def wgrad_cases(H: int, I: int, S: int, dev):
    """name -> (A [S, M], B [S, N]) of the two weight gradients: d_gate_up = d_h^T x, d_down = g^T act."""
    x = torch.randn(S, H, device=dev, dtype=torch.bfloat16)
    d_h = torch.randn(S, 2 * I, device=dev, dtype=torch.bfloat16)
    g = torch.randn(S, H, device=dev, dtype=torch.bfloat16)
    act = torch.randn(S, I, device=dev, dtype=torch.bfloat16)
    return {"d_gate_up (wgrad)": (d_h, x), "d_down (wgrad)": (g, act)}


def wgrad_impls(a, b, ends, out):
    """torch, kosmos (its default config), kosmos_<config> for each of WGRAD_CONFIGS, write (out.zero_())."""
    from kosmos.kernels.gemm_ws_host import WGRAD_CONFIGS, grouped_wgrad

    impls = {"torch": lambda: torch._grouped_mm(a.t(), b, offs=ends),
             "kosmos": lambda: grouped_wgrad(a, b, ends, out=out), "write": lambda: out.zero_()}
    for config in WGRAD_CONFIGS:
        impls[f"kosmos_{config}"] = lambda config=config: grouped_wgrad(a, b, ends, out=out, config=config)
    return impls


def swiglu_impls(a, b, ends, out, src, rows):
    """The up GEMM with its SwiGLU: kosmos's claimed split GEMM then the row kernel, or its SwiGLU epilogue, on the
    rows a; or those rows gathered from src by rows first (a is that copy) or inside the launch (the act comes out
    of each; h is `out` for the first, the first of the pair the others return)."""
    from kosmos.kernels.gemm_ws_host import grouped_mm, launch_grouped_mm_swiglu
    from kosmos.kernels.moe_rows import gather_rows, swiglu_rows

    kw = dict(m_fastest=True, claim=True, config="128x256s")
    return {"kosmos_mcs_rows": lambda: swiglu_rows(grouped_mm(a, b, ends, out=out, **kw)),
            "kosmos_mcs_swiglu": lambda: launch_grouped_mm_swiglu(a, b, ends, **kw),
            "gather_swiglu": lambda: launch_grouped_mm_swiglu(gather_rows(src, rows), b, ends, **kw),
            "swiglu_gathered": lambda: launch_grouped_mm_swiglu(src, b, ends, rows=rows, **kw)}


def routed_rows(T: int, ends_cpu: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """int64 source rows of the sorted pairs: each group led by a pad row (T), the rest tokens in [0, T)."""
    sizes = torch.diff(ends_cpu, prepend=ends_cpu.new_zeros(1)).tolist()
    return torch.cat([torch.cat([torch.tensor([T]), torch.randint(0, T, (n - 1,), generator=gen)]) for n in sizes])


def main() -> int:
    from kosmos.kernels.gemm_ws_host import grouped_mm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="qwen3_235b,deepseek_v3")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--impls", default="torch,kosmos,kosmos_m",
                   help="torch._grouped_mm, kosmos's kernel with n-fastest / m-fastest tiles in a group")
    p.add_argument("--wgrad", action="store_true",
                   help="the weight gradients (impls torch, kosmos, write; also kosmos_<config> of WGRAD_CONFIGS)")
    p.add_argument("--swiglu", action="store_true",
                   help="the up GEMM alone with impls kosmos_mcs (the matmul), kosmos_mcs_rows (+ the SwiGLU row "
                        "kernel), kosmos_mcs_swiglu (the SwiGLU epilogue: both in one launch), gather_swiglu (the "
                        "row gather, then the epilogue) and swiglu_gathered (the rows gathered in the launch)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.wgrad and args.impls == p.get_default("impls"):
        args.impls = "torch,kosmos,write"
    if args.swiglu and args.impls == p.get_default("impls"):
        args.impls = "kosmos_mcs,kosmos_mcs_rows,kosmos_mcs_swiglu,gather_swiglu,swiglu_gathered"
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layer in args.layers.split(","):
        H, I, E = LAYERS[layer]
        ends_cpu = routed_ends(args.T, E, args.k, gen)
        S = int(ends_cpu[-1])
        ends = ends_cpu.cuda()
        gemms = wgrad_cases(H, I, S, "cuda") if args.wgrad else cases(H, I, E, S, "cuda")
        if args.swiglu:  # the up GEMM's rows: a gathered copy of T tokens, as the layer has them
            from kosmos.kernels.moe_rows import gather_rows

            (x, b_up), = [v for k, v in gemms.items() if k.startswith("up")]
            src, src_rows = torch.randn(args.T, H, device="cuda", dtype=x.dtype), routed_rows(args.T, ends_cpu, gen)
            src_rows = src_rows.cuda()
            gemms = {"up (fwd, K-contig B)": (gather_rows(src, src_rows), b_up)}
        for name, (a, b) in gemms.items():
            if args.wgrad:  # the sum runs over the rows: K is a group's rows, (M, N) the gradient's shape
                K, N = a.shape[1], b.shape[1]
                ref = torch._grouped_mm(a.t(), b, offs=ends)
                out = torch.empty_like(ref)
                impls = wgrad_impls(a, b, ends, out)
            else:
                K, N = b.shape[1], b.shape[2]
                ref = torch._grouped_mm(a, b, offs=ends)
                out = torch.empty_like(ref)
                impls = {"torch": lambda: torch._grouped_mm(a, b, offs=ends),
                         "kosmos": lambda: grouped_mm(a, b, ends, out=out),
                         "kosmos_m": lambda: grouped_mm(a, b, ends, out=out, m_fastest=True),
                         "kosmos_mc": lambda: grouped_mm(a, b, ends, out=out, m_fastest=True, claim=True),
                         "kosmos_ms": lambda: grouped_mm(a, b, ends, out=out, m_fastest=True, config="128x256s"),
                         "kosmos_mcs": lambda: grouped_mm(a, b, ends, out=out, m_fastest=True, claim=True,
                                                          config="128x256s")}
                if args.swiglu:
                    impls.update(swiglu_impls(a, b, ends, out, src, src_rows))
            unknown = set(args.impls.split(",")) - set(impls)
            if unknown:
                raise SystemExit(f"--impls: unknown {sorted(unknown)}; here: {sorted(impls)}")
            impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
            r = {"layer": layer, "T": args.T, "gemm": name, "S": S, "K": K, "N": N, "rounds": {}}
            for impl, fn in impls.items():
                if impl not in ("torch", "write"):
                    res = fn()
                    got = res[0] if isinstance(res, tuple) else out
                    r[f"rel_err_{impl}"] = rel_err(got, ref)
            t = {impl: [] for impl in impls}
            for _ in range(args.rounds):
                for impl, fn in impls.items():
                    t[impl].append(timed(fn, args.reps))
            flops = 2 * S * K * N
            r["rounds"] = t
            r.update({f"ms_{k}": statistics.median(v) for k, v in t.items()})
            r.update({f"tflops_{k}": flops / r[f"ms_{k}"] / 1e9 for k in t})
            rows.append(r)
            del ref, out
        torch.cuda.empty_cache()
    names = args.impls.split(",")
    print(f"{'layer':>12} {'gemm':>24} {'S':>7} {'K':>5} {'N':>5} | " + " | ".join(f"{n + ' ms':>11} {'TF/s':>4}"
                                                                             for n in names) + " | rel err")
    for r in rows:
        cells = " | ".join(f"{r[f'ms_{n}']:>11.3f} {r[f'tflops_{n}']:>4.0f}" for n in names)
        errs = " ".join(f"{r[k]:.1e}" for k in r if k.startswith("rel_err"))
        print(f"{r['layer']:>12} {r['gemm']:>24} {r['S']:>7} {r['K']:>5} {r['N']:>5} | {cells} | {errs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
