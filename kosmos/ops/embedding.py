"""kosmos::embedding: an embedding lookup whose backward is aten's kernel, kept whole through AOT autograd.

Inductor decomposes aten.embedding_dense_backward into an fp32 [num_weights, H] buffer filled by atomic adds and then
cast to the weight's dtype; for a language model's vocabulary that transient is GiBs (Qwen3: 151936 x 4096 fp32 =
2.3 GiB) and lands on the training step's peak, beside every weight gradient made before it. aten's CUDA kernel sorts
the indices and sums each row's gradients in fp32 registers, writing only the result in the weight's dtype. As custom
ops both directions stay aten calls (the pre-grad pass puts this op where the model calls F.embedding)."""
from __future__ import annotations

import torch


@torch.library.custom_op("kosmos::embedding", mutates_args=())
def embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """F.embedding(indices, weight, padding_idx, scale_grad_by_freq=...) with padding_idx normalized (-1: none)."""
    _check(weight, indices)
    return torch.ops.aten.embedding(weight, indices, padding_idx, scale_grad_by_freq)


@embedding.register_fake
def _embedding_fake(weight, indices, padding_idx, scale_grad_by_freq):
    _check(weight, indices)
    return weight.new_empty((*indices.shape, weight.shape[1]))


@torch.library.custom_op("kosmos::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                       scale_grad_by_freq: bool) -> torch.Tensor:
    """d weight [num_weights, H] in grad's dtype: aten.embedding_dense_backward."""
    return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


@embedding_backward.register_fake
def _embedding_backward_fake(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _check(weight: torch.Tensor, indices: torch.Tensor) -> None:
    if weight.dim() != 2:
        raise ValueError(f"kosmos::embedding: weight must be 2-D [num_weights, H], got {tuple(weight.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kosmos::embedding: indices must be int32 or int64, got {indices.dtype}")


def _setup_context(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq = weight.shape[0], padding_idx, scale_grad_by_freq


def _autograd(ctx, grad):
    (indices,) = ctx.saved_tensors
    d_weight = None
    if ctx.needs_input_grad[0]:
        d_weight = torch.ops.kosmos.embedding_backward(grad, indices, ctx.num_weights, ctx.padding_idx,
                                                       ctx.scale_grad_by_freq)
    return d_weight, None, None, None


embedding.register_autograd(_autograd, setup_context=_setup_context)
