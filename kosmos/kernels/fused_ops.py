"""Plugs the fused CUDA kernels into `kosmos::ag_gemm` / `kosmos::gemm_rs` (kosmos.ops.dispatch).

`why_not_*` gives the reason a call takes the reference path (logged and shown in kosmos.report()), or None
when the fused kernel runs:
- dtype other than bfloat16/float16, out_dtype other than the input's;
- gather_dim / scatter_dim > 0 with B >= 2 batch entries (everything before the dim; s = rows per entry,
  everything from the dim on, per rank for AG, per output chunk for RS) when s is not a multiple of the
  tile (128 rows, or 64 with the smaller tile), or when REMAP_ROWS is switched off. Otherwise the kernels remap rows
  (gathered / input row b*W*s + r*s + i): fused, no copy. B == 1 is the dim-0 layout;
- strides or base addresses that TMA cannot take (16-byte alignment), layouts other than row-major input
  and row-major / transposed-view weights, weights of mixed layouts, more than 4 weights (pairs);
- tiny M (fewer than MIN_ROWS rows in the gathered / reduced operand): fusion cannot win there;
- groups without NCCL (symmetric memory needs CUDA peers), GPUs before sm_90 (TMA).
World size 1 is fused (every comm task still runs, locally).

Importing this module registers the impls; it needs no GPU to import.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

from kosmos.kernels import moe_ops
from kosmos.ops import dispatch

MIN_ROWS = 128
# Gathers / scatters along a dim > 0 with B >= 2 batch entries run fused by row remapping in the kernels
# (tests/test_fused_gpu.py -k dim1 passed on an H200, 2026-11-29). KOSMOS_REMAP_ROWS=0 (or setting this to
# False) sends those calls to the reference path, with that reason; the dim-0 path does not depend on it.
REMAP_ROWS = os.environ.get("KOSMOS_REMAP_ROWS", "1") != "0"
MAX_WEIGHTS = 4
_DTYPES = (torch.bfloat16, torch.float16)


def _weight_layout(w: torch.Tensor) -> Optional[tuple[bool, int]]:
    if w.dim() != 2:
        return None
    try:
        from kosmos.kernels.ag_gemm import _weight_view

        return _weight_view(w)
    except ValueError:
        return None


def _rows_view(x: torch.Tensor) -> Optional[torch.Tensor]:
    """x as [rows, K] without a copy, or None."""
    if x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def _misaligned(t: torch.Tensor) -> bool:
    """Base address not 16-byte aligned. Fake/functional tensors (the pass asks at compile time) have no
    address: they count as aligned, and the real call is checked again at run time."""
    try:
        from torch._subclasses.fake_tensor import is_fake

        if is_fake(t):
            return False
        return t.data_ptr() % 16 != 0
    except RuntimeError:
        return False


def _tma_ok(name: str, t: torch.Tensor, lead: int) -> Optional[str]:
    size = t.element_size()
    if _misaligned(t):
        return f"{name} base address is not 16-byte aligned (TMA)"
    if (lead * size) % 16:
        return f"{name} row stride {lead} x {size} B is not a multiple of 16 bytes (TMA)"
    return None


def _remap_reason(op: str, dim_name: str, lead, dim: int, world_size: int, cfg_of) -> Optional[str]:
    """Why a gather / scatter along `dim` of an operand with leading dims `lead` cannot be remapped (None:
    dim 0, one batch entry, or remappable). cfg_of(seg) -> the kernel's tile config or None."""
    if dim == 0:
        return None
    from kosmos.kernels.ag_gemm import REMAP_SMALL_BLOCK_M
    from kosmos.kernels.queue import split_rows

    B, s = split_rows(lead, dim)
    if op == "gemm_rs":
        s //= world_size
    if B == 1:
        return None  # the dim-0 layout
    if not REMAP_ROWS:
        return (f"{dim_name} {dim} > 0 with {B} batch entries: row remapping is switched off "
                f"(KOSMOS_REMAP_ROWS=0 / kosmos.kernels.fused_ops.REMAP_ROWS)")
    if cfg_of(s) is None:
        big = cfg_of(None).block_m
        return (f"{dim_name} {dim}: rows per batch entry s={s} not a multiple of the tile "
                f"({big} or {REMAP_SMALL_BLOCK_M} rows; B={B} batch entries)")
    return None


def _device_reason(t: torch.Tensor) -> Optional[str]:
    if t.device.type != "cuda":
        return f"{t.device.type} tensors"
    if torch.cuda.get_device_capability(t.device)[0] < 9:
        return "TMA descriptors need compute capability >= 9.0"
    return None


def _group_reason(group_name: str, world_size: int) -> Optional[str]:
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(group_name)
        if dist.get_world_size(pg) != world_size:
            return f"group {group_name} has {dist.get_world_size(pg)} ranks, op says {world_size}"
        backend = str(dist.get_backend(pg)).lower()
    except Exception as e:  # noqa: BLE001
        return f"process group {group_name!r} not usable for symmetric memory ({type(e).__name__}: {e})"
    if "nccl" not in backend:
        return f"group backend {backend}: symmetric memory needs an NCCL (CUDA) group"
    return None


def _weights_reason(weights: Sequence[torch.Tensor], dtype) -> tuple[Optional[str], Optional[bool]]:
    trans = set()
    for i, w in enumerate(weights):
        if w.dtype != dtype:
            return f"weights[{i}] dtype {w.dtype} != input dtype {dtype}", None
        lay = _weight_layout(w)
        if lay is None:
            return f"weights[{i}] strides {tuple(w.stride())}: neither row-major nor a transposed view", None
        r = _tma_ok(f"weights[{i}]", w, lay[1])
        if r:
            return r, None
        if (w.shape[1] * w.element_size()) % 16:
            return f"weights[{i}] N={w.shape[1]}: output rows not a multiple of 16 bytes (TMA)", None
        trans.add(lay[0])
    if len(trans) > 1:
        return "weights mix row-major and transposed layouts", None
    return None, trans.pop()


def _bias_reason(name: str, b: Optional[torch.Tensor], dtype) -> Optional[str]:
    if b is None:
        return None
    if b.dtype != dtype:
        return f"{name} dtype {b.dtype} != input dtype {dtype}"
    if b.stride(0) != 1 and b.numel() > 1:
        return f"{name} is not contiguous"
    if _misaligned(b):
        return f"{name} base address is not 16-byte aligned"
    return None


def why_not_ag_gemm(a, weights, biases, gather_dim, world_size, group_name, return_gathered=False,
                    out_dtype=None) -> Optional[str]:
    r = _device_reason(a)
    if r:
        return r
    if a.dtype not in _DTYPES:
        return f"dtype {a.dtype}: the fused kernels take bfloat16/float16"
    if out_dtype is not None and out_dtype != a.dtype:
        return f"out_dtype {out_dtype} != input dtype {a.dtype} (fused epilogue stores the input dtype)"
    if len(weights) > MAX_WEIGHTS:
        return f"{len(weights)} weights > {MAX_WEIGHTS} per launch"
    a2 = _rows_view(a)
    if a2 is None:
        return f"input strides {tuple(a.stride())} do not flatten to rows"
    m, K = a2.shape
    if m == 0 or K == 0 or any(w.shape[1] == 0 for w in weights):
        return "empty operand"
    if m * world_size < MIN_ROWS:
        return f"M={m * world_size} gathered rows < {MIN_ROWS}: too small for fusion to win"
    r = _tma_ok("input", a2, a2.stride(0))
    if r:
        return r
    if (K * a.element_size()) % 16:
        return f"K={K}: gathered rows not a multiple of 16 bytes (TMA)"
    if gather_dim != 0:
        from kosmos.kernels.ag_gemm import ag_config

        ns = [w.shape[1] for w in weights]
        r = _remap_reason("ag_gemm", "gather_dim", a.shape[:-1], gather_dim, world_size,
                          lambda seg: ag_config(world_size, m, ns, K, a.dtype, seg))
        if r:
            return r
    r, _ = _weights_reason(weights, a.dtype)
    if r:
        return r
    for i, b in enumerate(biases):
        r = _bias_reason(f"biases[{i}]", b, a.dtype)
        if r:
            return r
    return _group_reason(group_name, world_size)


def why_not_gemm_rs(inputs, weights, bias, scatter_dim, reduce_op, world_size, group_name,
                    out_dtype=None) -> Optional[str]:
    x0 = inputs[0]
    r = _device_reason(x0)
    if r:
        return r
    if x0.dtype not in _DTYPES:
        return f"dtype {x0.dtype}: the fused kernels take bfloat16/float16"
    if out_dtype is not None and out_dtype != x0.dtype:
        return f"out_dtype {out_dtype} != input dtype {x0.dtype}"
    if len(inputs) > MAX_WEIGHTS:
        return f"{len(inputs)} (input, weight) pairs > {MAX_WEIGHTS} per launch"
    N = weights[0].shape[1]
    for i, x in enumerate(inputs):
        if x.dtype != x0.dtype:
            return f"inputs[{i}] dtype {x.dtype} != {x0.dtype}"
        x2 = _rows_view(x)
        if x2 is None:
            return f"inputs[{i}] strides {tuple(x.stride())} do not flatten to rows"
        if x2.numel() == 0:
            return "empty operand"
        r = _tma_ok(f"inputs[{i}]", x2, x2.stride(0))
        if r:
            return r
    M = inputs[0].numel() // inputs[0].shape[-1]
    if M < MIN_ROWS:
        return f"M={M} rows < {MIN_ROWS}: too small for fusion to win"
    if N == 0:
        return "empty operand"
    if (N * x0.element_size()) % 16:
        return f"N={N}: output rows not a multiple of 16 bytes"
    if scatter_dim != 0:
        from kosmos.kernels.gemm_rs import rs_config

        ks = [x.shape[-1] for x in inputs]
        r = _remap_reason("gemm_rs", "scatter_dim", x0.shape[:-1], scatter_dim, world_size,
                          lambda seg: rs_config(M, N, ks, x0.dtype, world_size, seg))
        if r:
            return r
    r, _ = _weights_reason(weights, x0.dtype)
    if r:
        return r
    r = _bias_reason("bias", bias, x0.dtype)
    if r:
        return r
    return _group_reason(group_name, world_size)


def run_ag_gemm(a, weights, biases, gather_dim, world_size, group_name, return_gathered=False, out_dtype=None):
    from kosmos.kernels.ag_gemm import ag_gemm_group

    return ag_gemm_group(a, list(weights), list(biases), world_size, group_name, return_gathered, out_dtype,
                         gather_dim=gather_dim)


def run_gemm_rs(inputs, weights, bias, scatter_dim, reduce_op, world_size, group_name, out_dtype=None):
    from kosmos.kernels.gemm_rs import gemm_rs_group

    return gemm_rs_group(list(inputs), list(weights), bias, reduce_op, world_size, group_name, out_dtype,
                         scatter_dim=scatter_dim)


def register() -> None:
    dispatch.register_fused("ag_gemm", why_not_ag_gemm, run_ag_gemm)
    dispatch.register_fused("gemm_rs", why_not_gemm_rs, run_gemm_rs)
    moe_ops.register()  # kosmos::moe_layer / moe_layer_backward (env KOSMOS_FUSED_MOE: which directions)


def workspace_bytes() -> dict:
    """Bytes per GPU of every live fused-kernel workspace (for the explain report)."""
    from kosmos.kernels.runtime import workspace_bytes as _wb

    return _wb()


register()
