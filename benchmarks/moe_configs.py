"""Tile configs of the fused MoE forward (kosmos.kernels.moe.moe_forward) on one layer's dims: each config's
median time (measure.bench_calls: 10+ calls, L2 flushed), its output checked bit-identical to the default config's or
within bf16 tolerance (a different BK changes the sum order), and the router + routing timed alone as a floor.

    PYTHONPATH=. python3 benchmarks/moe_configs.py --layer qwen3_235b --T 16384 --configs default,bi128,bi128_s4
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.moe import LAYERS
from kosmos.kernels.moe import WIDE_FORWARD, wide_forward
from measure import bench_calls

CONFIGS = {  # name -> MoeConfig fields replaced on the default
    "default": {},
    "bi128": dict(bi=128),
    "bi128_s4": dict(bi=128, num_stages=4),
    "bn256": dict(bn=256),
    "bi128_bn256": dict(bi=128, bn=256),
    # WIDE_FORWARD with 4 stages: 196640 / 200704 bytes of shared memory for the Qwen3 / DeepSeek-V3 builds (sm_90
    # compile on the CPU, ninth session), no wgmma serialization; timed in the fifty-seventh session (with 32-token
    # tiles, moe.wide_forward): faster for Qwen3-30B-A3B, slower for DeepSeek-V3
    "bi128_bn256_s4": dict(bi=128, bn=256, num_stages=4),
    "bk128": dict(bk=128, bk2=128, num_stages=2),
    "w4": dict(num_warps=4),
    "wide": None,  # what moe_forward tries first: moe.wide_forward(the layer's experts)
    # one warpgroup per program and two programs per SM (81936 bytes of shared memory, 255 registers x 128 threads:
    # sm_90 compile on the CPU, thirty-fourth session): a program's CTA barriers in its K loops (3 per K step in the
    # 8-warp build) then hold one warpgroup, while the SM's other program runs its wgmma. On the H200 27-43% slower
    # than "wide" at T = 16384 (RESULTS.md, thirty-fifth session)
    "wide_bm64_w4_s2_2sm": dict(WIDE_FORWARD, bm=64, num_warps=4, num_stages=2, programs_per_sm=2),
}


def main() -> None:
    from kosmos.kernels import moe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", default="qwen3_235b", choices=list(LAYERS))
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--configs", default="default,bi128")
    args = p.parse_args()
    d = LAYERS[args.layer]
    H, I, E, k = d["H"], d["I"], d["E"], d["k"]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    hidden = torch.randn(args.T, H, device=dev, dtype=dt)
    rw = torch.randn(E, H, device=dev, dtype=dt) / H**0.5
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5
    down = torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5
    base = moe.select_config(hidden, gu, E)
    ref = None
    flops = 2 * args.T * k * (H * 2 * I + I * H)
    print(f"{args.layer} T={args.T}: {flops / 1e12:.2f} TFLOP of expert GEMMs")
    for name in args.configs.split(","):
        fields = dict(CONFIGS[name] if CONFIGS[name] is not None else wide_forward(E))
        programs = fields.pop("programs_per_sm", 1) * torch.cuda.get_device_properties(dev).multi_processor_count
        cfg = dataclasses.replace(base, **fields)
        try:
            def fn(cfg=cfg, programs=programs):
                return moe.moe_forward(hidden, rw, None, None, gu, down, k, config=cfg, programs=programs)
            out = fn()[0]
            ms = bench_calls(fn, 10, 60)
        except Exception as e:  # noqa: BLE001  (a config that does not fit: say so, go on)
            print(f"{name:>14}: failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        if ref is None:
            ref = out
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        same = torch.equal(out, ref)
        print(f"{name:>14}: {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TF/s  "
              f"vs first: {'bit-identical' if same else f'rel err {err:.1e}'}")


if __name__ == "__main__":
    main()
