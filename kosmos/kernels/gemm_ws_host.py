"""Host side of the warp-specialized GEMM (gemm_ws.py): whether this triton and device can run it, and its launch.

Kept apart from gemm.py because the kernel is written in Gluon (triton.experimental.gluon), whose API is
experimental: a triton without it, or with a different warp_specialize signature, reports why here and the
caller picks the Triton kernel instead.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Optional

import torch


@functools.lru_cache(maxsize=1)
def gluon_missing() -> Optional[str]:
    """None when this triton has the Gluon pieces gemm_ws.py is written against (triton 3.6's API), else why not."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

        from kosmos.kernels import gemm_ws  # noqa: F401
    except Exception as e:  # ImportError, or an API that moved: the message is the reason
        return f"triton.experimental.gluon unavailable ({type(e).__name__}: {e})"
    params = list(inspect.signature(gl.warp_specialize).parameters)
    if params[:3] != ["functions_and_args", "worker_num_warps", "worker_num_regs"]:
        return f"gluon warp_specialize takes {params[:3]}, not the (functions_and_args, ...) form of triton 3.6"
    return None


def unsupported(a: torch.Tensor, lay) -> Optional[str]:
    """Why the warp-specialized kernel cannot take A (with the call's GemmLayout), or None."""
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {a.dtype} (bf16 / fp16 only)"
    if lay.a_trans:
        return "A is a transposed view (the kernel loads [BLOCK_M, BLOCK_K] blocks of a row-major A)"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton interpreter does not run Gluon kernels"
    if a.device.type != "cuda" or torch.cuda.get_device_capability(a.device) != (9, 0):
        return "wgmma needs an sm_90 GPU"
    return gluon_missing()


def launch(a, b, bias, c, cfg, lay, plan, ws, cnt, programs: int, **overrides) -> None:
    """C = a @ b (+ bias) with gemm_ws_kernel on `programs` programs (checked by unsupported() first), on the
    schedule `plan` (gemm.plan_gemm: whole tiles, then half tiles or the stream-K tail; ws / cnt: the stream-K
    tail's partial slots and zeroed counters).
    overrides: kernel constexprs to replace (register budgets, partition sizes) when probing variants."""
    if (plan.sk_tiles or plan.half_tiles) and cfg.ws_consumers != 1:
        raise ValueError(f"gemm_ws: config {cfg.name}: a tail schedule runs with one consumer")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kosmos.kernels.gemm_ws import gemm_ws_kernel

    el = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    BM, BN, BK = cfg.block_m, cfg.block_n, cfg.block_k
    M, N, K = lay.M, lay.N, lay.K

    def desc(t, shape, lead, block):
        return TensorDescriptor(t, shape, [lead, 1], block, gl.NVMMASharedLayout.get_default_for(block, el))

    a_desc = desc(a, [M, K], lay.a_lead, [BM, BK])
    if lay.b_trans:
        b_desc = desc(b, [N, K], lay.b_lead, [BN, BK])
    else:
        b_desc = desc(b, [K, N], lay.b_lead, [BK, BN])
    c_desc = desc(c, [M, N], c.stride(0), [BM, BN])
    if plan.half_tiles:
        a_half_desc = desc(a, [M, K], lay.a_lead, [BM // 2, BK])
        c_half_desc = desc(c, [M, N], c.stride(0), [BM // 2, BN])
    else:
        a_half_desc, c_half_desc = a_desc, c_desc
    gemm_ws_kernel[(programs,)](a_desc, a_half_desc, b_desc, c_desc, c_half_desc, bias if bias is not None else c,
                                ws, cnt, M, N, K,
                                plan.dp_tiles, plan.sk_tiles, plan.sk_iters, plan.sk_workers, plan.sk_max_contrib,
                                BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                                B_TRANS=lay.b_trans, HAS_BIAS=bias is not None, STREAM_K=plan.sk_tiles > 0,
                                HALF_TAIL=plan.half_tiles > 0,
                                **{**dict(CONSUMER_REGS=232, PRODUCER_REGS=40, NUM_CONSUMERS=cfg.ws_consumers,
                                          PRODUCER_WARPS=1, CONSUMER_WARPS=cfg.num_warps), **overrides},
                                num_warps=cfg.num_warps)
