"""MoE benchmark, EP mode (`benchmarks/moe.py --ep`): the expert-parallel fused forward in SimWorld on one GPU.
On several GPUs (torchrun, one process per GPU) `--dist` runs benchmarks/moe_ep_dist.py instead:

    torchrun --nproc-per-node 2 benchmarks/moe_ep.py --dist --layers qwen3_30b_a3b --tokens 4096,16384

W simulated ranks share one GPU, so this measures correctness and the COST of the dispatch / combine tasks, not a
multi-GPU speedup: the same total work (W ranks x T/W tokens, E experts spread E/W per rank) runs once as the EP
kernel (routed rows pushed to the owners' receive regions and the results pushed back, all in one launch) and once
as the non-EP fused kernel over all T tokens and all E experts; overhead = t_ep / t_local - 1; the same for the
backward kernels (EP backward: rows, grads and weights dispatched, d_x rows and d_w partials pushed back). The
workspace column is the forward's bytes per rank (ep_workspace_bytes). Each EP run is first
checked per rank against the reference `experts` on the kernel's routing (rel. error). Times: medians of
measure.bench_calls (10+ calls, L2 flushed), bf16.

    PYTHONPATH=. python3 benchmarks/moe.py --ep 2,4,8 --ts 16384 --only qwen3_30b --json ep.json
"""
from __future__ import annotations

import json

import torch

from measure import bench_calls

LAYERS = {
    "qwen3_30b_a3b": dict(H=2048, I=768, E=128, k=8),
    "qwen3_235b": dict(H=4096, I=1536, E=128, k=8),
    "deepseek_v3": dict(H=7168, I=2048, E=256, k=8, scoring="sigmoid", n_group=8, topk_group=4, rsf=2.5),
}


def _weights(d, T, W, device):
    g = torch.Generator(device=device).manual_seed(0)
    H, I, E = d["H"], d["I"], d["E"]
    bf = torch.bfloat16
    h = torch.randn(W, T // W, H, device=device, generator=g).to(bf)
    rw = (torch.randn(E, H, device=device, generator=g) / H ** 0.5).to(bf)
    gu = (torch.randn(E, 2 * I, H, device=device, generator=g) / H ** 0.5).to(bf)
    dn = (torch.randn(E, H, I, device=device, generator=g) / I ** 0.5).to(bf)
    corr = (torch.randn(E, device=device, generator=g) * 0.01) if d.get("scoring") == "sigmoid" else None
    return h, rw, gu, dn, corr


def run_cell(layer: str, T: int, W: int, warmup: int, rep: int) -> dict:
    from kosmos.kernels.moe import moe_forward
    from kosmos.kernels.moe_backward import moe_backward
    from kosmos.kernels.moe_ep import ep_workspace_bytes
    from kosmos.kernels.runtime import SimWorld
    from kosmos.ops.moe_math import experts

    d = LAYERS[layer]
    H, I, E, k = d["H"], d["I"], d["E"], d["k"]
    h, rw, gu, dn, corr = _weights(d, T, W, "cuda")
    router = dict(scoring=d.get("scoring", "softmax"), norm_topk_prob=True, n_group=d.get("n_group", 1),
                  topk_group=d.get("topk_group", 1), routed_scaling_factor=d.get("rsf", 1.0))
    sw = SimWorld(W)
    gus, dns = gu.view(W, E // W, 2 * I, H), dn.view(W, E // W, H, I)

    def ep():
        return sw.moe_layer(h, rw, None, corr, gus, dns, k, **router)

    def local():
        return moe_forward(h.view(T, H), rw, None, corr, gu, dn, k, **router)

    go = torch.randn_like(h)

    def ep_bwd():
        return sw.moe_layer_backward(go, None, h, rw, None, corr, gus, dns, k, **router)

    def local_bwd():
        return moe_backward(go.view(T, H), None, h.view(T, H), rw, None, corr, gu, dn, k, **router)

    out, _, tpe, ids, wts = sw.moe_layer(h, rw, None, corr, gus, dns, k, **router, return_routing=True)
    errs = []
    for r in range(W):
        ref, _ = experts(h[r], ids[r].long(), wts[r].to(torch.bfloat16), gu, dn)
        errs.append(float((out[r].double() - ref.double()).norm() / ref.double().norm()))
    sw.workspace.check()
    t_ep = bench_calls(ep, warmup, rep)
    t_local = bench_calls(local, warmup, rep)
    t_ep_bwd = bench_calls(ep_bwd, warmup, rep)
    t_local_bwd = bench_calls(local_bwd, warmup, rep)
    sw.workspace.check()
    return dict(layer=layer, T=T, W=W, t_ep_ms=t_ep, t_local_ms=t_local, overhead=t_ep / t_local - 1,
                t_ep_bwd_ms=t_ep_bwd, t_local_bwd_ms=t_local_bwd, overhead_bwd=t_ep_bwd / t_local_bwd - 1,
                max_rel_err=max(errs), tokens_per_expert_max=int(tpe[0].max()),
                workspace_bytes_per_rank=ep_workspace_bytes(W, E, T // W, k, H, 2, 2))


def table(rows) -> str:
    head = (f"{'layer':<15} {'T':>6} {'W':>2} {'EP ms':>8} {'local ms':>9} {'overhead':>9} {'EP bwd':>8} "
            f"{'local bwd':>9} {'overhead':>9} {'rel err':>9} {'ws/rank':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layer']:<15} {r['T']:>6} {r['W']:>2} {r['t_ep_ms']:>8.3f} {r['t_local_ms']:>9.3f} "
                     f"{100 * r['overhead']:>8.1f}% {r['t_ep_bwd_ms']:>8.3f} {r['t_local_bwd_ms']:>9.3f} "
                     f"{100 * r['overhead_bwd']:>8.1f}% {r['max_rel_err']:>9.2e} "
                     f"{r['workspace_bytes_per_rank'] / 2**30:>7.2f}Gi")
    return "\n".join(lines)


def main(worlds, ts, only: str, warmup: int, rep: int, json_path: str) -> int:
    rows = []
    for layer in LAYERS:
        if only and only not in layer:
            continue
        for T in ts:
            for W in worlds:
                rows.append(run_cell(layer, T, W, warmup, rep))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                torch.cuda.empty_cache()
    print(table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    if "--dist" not in sys.argv[1:]:
        sys.exit("the SimWorld mode runs through benchmarks/moe.py --ep; pass --dist (under torchrun) for several GPUs")
    import moe_ep_dist

    sys.exit(moe_ep_dist.main(sys.argv[1:]))
