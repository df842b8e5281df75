"""TP+SP ops `kosmos::ag_gemm` and `kosmos::gemm_rs`: schemas, fake impls and reference impls.

Semantics (the passes rewrite to exactly this; the fused CUDA kernels must match it):

ag_gemm(a, weights, biases, gather_dim, world_size, group_name, return_gathered, out_dtype)
    gathered = cat([a from rank r for r in range(world_size)], dim=gather_dim)   # [..., K]
    out_i    = gathered @ weights[i] (+ biases[i])                               # [..., N_i]
    returns [out_0, ..., out_{n-1}] + ([gathered] if return_gathered else [])

gemm_rs(inputs, weights, bias, scatter_dim, reduce_op, world_size, group_name, out_dtype)
    full  = sum_i (inputs[i] @ weights[i] (+ bias if i == 0)).to(out_dtype)   # inputs[i]: [..., K_i], same leading dims
    out   = reduce_op over ranks of full, chunk `rank` of `world_size` along scatter_dim
    reduce_op is "sum" or "avg".

`weights[i]` is the matmul's right operand [K, N] as the graph has it (usually a transposed view of a
Linear weight). The reference impls use functional collectives and torch math: they run on any device
and process-group backend (gloo on CPU included).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kosmos.ops import dispatch

_FUNCTIONAL = torch.ops._c10d_functional


def _check_matmul_operands(op: str, a: torch.Tensor, weights: Sequence[torch.Tensor], biases) -> None:
    if a.dim() < 2:
        raise ValueError(f"kosmos::{op}: input must have >= 2 dims, got shape {tuple(a.shape)}")
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[0] != a.shape[-1]:
            raise ValueError(
                f"kosmos::{op}: weights[{i}] must be [K={a.shape[-1]}, N], got {tuple(w.shape)}"
            )
        if w.dtype != a.dtype:
            raise TypeError(f"kosmos::{op}: weights[{i}] dtype {w.dtype} != input dtype {a.dtype}")
    for i, b in enumerate(biases):
        if b is not None and (b.dim() != 1 or b.shape[0] != weights[i].shape[1]):
            raise ValueError(f"kosmos::{op}: biases[{i}] must be [N={weights[i].shape[1]}], got {tuple(b.shape)}")


def _gathered_shape(a: torch.Tensor, gather_dim: int, world_size: int) -> list[int]:
    shape = list(a.shape)
    shape[gather_dim] *= world_size
    return shape


def _check_ag_args(a, weights, biases, gather_dim, world_size):
    if len(weights) == 0:
        raise ValueError("kosmos::ag_gemm: needs at least one weight")
    if len(biases) != len(weights):
        raise ValueError(f"kosmos::ag_gemm: {len(biases)} biases for {len(weights)} weights")
    if not 0 <= gather_dim < a.dim() - 1:
        raise ValueError(f"kosmos::ag_gemm: gather_dim {gather_dim} must index a non-contracted dim of "
                         f"{tuple(a.shape)}")
    if world_size < 1:
        raise ValueError(f"kosmos::ag_gemm: world_size {world_size} < 1")
    _check_matmul_operands("ag_gemm", a, weights, biases)


def _linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], out_dtype) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.addmm(b, x2, w) if b is not None else torch.mm(x2, w)
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y.view(*lead, w.shape[1])


def all_gather_along(a: torch.Tensor, gather_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Functional all-gather concatenating the ranks' shards along `gather_dim`."""
    raw = _FUNCTIONAL.wait_tensor(
        _FUNCTIONAL.all_gather_into_tensor(a.contiguous(), world_size, group_name)
    )
    if gather_dim == 0:
        return raw
    return torch.cat(torch.chunk(raw, world_size, dim=0), dim=gather_dim)


def reduce_scatter_along(full: torch.Tensor, scatter_dim: int, reduce_op: str, world_size: int, group_name: str):
    """Functional reduce-scatter of `full` whose result is chunk `rank` along `scatter_dim`."""
    if scatter_dim != 0:
        full = torch.cat(torch.chunk(full, world_size, dim=scatter_dim), dim=0)
    return _FUNCTIONAL.wait_tensor(
        _FUNCTIONAL.reduce_scatter_tensor(full.contiguous(), reduce_op, world_size, group_name)
    )


@torch.library.custom_op("kosmos::ag_gemm", mutates_args=())
def ag_gemm(
    a: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[Optional[torch.Tensor]],
    gather_dim: int,
    world_size: int,
    group_name: str,
    return_gathered: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> list[torch.Tensor]:
    _check_ag_args(a, weights, biases, gather_dim, world_size)
    args = (a, weights, biases, gather_dim, world_size, group_name, return_gathered, out_dtype)
    done, fused_out = dispatch.try_fused("ag_gemm", a.device, *args)
    if done:
        return fused_out
    gathered = all_gather_along(a, gather_dim, world_size, group_name)
    outs = [_linear(gathered, w, b, out_dtype) for w, b in zip(weights, biases)]
    return outs + ([gathered] if return_gathered else [])


@ag_gemm.register_fake
def _ag_gemm_fake(a, weights, biases, gather_dim, world_size, group_name, return_gathered=False, out_dtype=None):
    _check_ag_args(a, weights, biases, gather_dim, world_size)
    shape = _gathered_shape(a, gather_dim, world_size)
    dtype = out_dtype or a.dtype
    outs = [a.new_empty(shape[:-1] + [w.shape[1]], dtype=dtype) for w in weights]
    return outs + ([a.new_empty(shape)] if return_gathered else [])


def _check_rs_args(inputs, weights, bias, scatter_dim, reduce_op, world_size):
    if len(inputs) == 0 or len(inputs) != len(weights):
        raise ValueError(f"kosmos::gemm_rs: needs as many inputs as weights (>= 1), "
                         f"got {len(inputs)} and {len(weights)}")
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"kosmos::gemm_rs: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    lead = inputs[0].shape[:-1]
    n = weights[0].shape[-1]
    for i, (x, w) in enumerate(zip(inputs, weights)):
        if x.shape[:-1] != lead:
            raise ValueError(f"kosmos::gemm_rs: inputs[{i}] leading shape {tuple(x.shape[:-1])} != {tuple(lead)}")
        _check_matmul_operands("gemm_rs", x, [w], [None])
        if w.shape[1] != n:
            raise ValueError(f"kosmos::gemm_rs: weights[{i}] has N={w.shape[1]}, expected {n}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"kosmos::gemm_rs: bias must be [N={n}], got {tuple(bias.shape)}")
    if not 0 <= scatter_dim < inputs[0].dim() - 1:
        raise ValueError(f"kosmos::gemm_rs: scatter_dim {scatter_dim} must index a non-contracted dim")
    if lead[scatter_dim] % world_size != 0:
        raise ValueError(
            f"kosmos::gemm_rs: dim {scatter_dim} of size {lead[scatter_dim]} is not divisible by "
            f"world size {world_size}"
        )


@torch.library.custom_op("kosmos::gemm_rs", mutates_args=())
def gemm_rs(
    inputs: list[torch.Tensor],
    weights: list[torch.Tensor],
    bias: Optional[torch.Tensor],
    scatter_dim: int,
    reduce_op: str,
    world_size: int,
    group_name: str,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    _check_rs_args(inputs, weights, bias, scatter_dim, reduce_op, world_size)
    args = (inputs, weights, bias, scatter_dim, reduce_op, world_size, group_name, out_dtype)
    done, fused_out = dispatch.try_fused("gemm_rs", inputs[0].device, *args)
    if done:
        return fused_out
    full = _linear(inputs[0], weights[0], bias, out_dtype)
    for x, w in zip(inputs[1:], weights[1:]):
        full = full + _linear(x, w, None, out_dtype)
    return reduce_scatter_along(full, scatter_dim, reduce_op, world_size, group_name)


@gemm_rs.register_fake
def _gemm_rs_fake(inputs, weights, bias, scatter_dim, reduce_op, world_size, group_name, out_dtype=None):
    _check_rs_args(inputs, weights, bias, scatter_dim, reduce_op, world_size)
    shape = list(inputs[0].shape[:-1]) + [weights[0].shape[1]]
    shape[scatter_dim] //= world_size
    return inputs[0].new_empty(shape, dtype=out_dtype or inputs[0].dtype)
