"""Small TP+SP modules for pass tests: an MLP and an attention block with sequence-parallel norms."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

H, I, HEADS, HEAD_DIM = 64, 128, 4, 16


class MLP(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.gate = nn.Linear(H, I, bias=bias)
        self.up = nn.Linear(H, I, bias=bias)
        self.down = nn.Linear(I, H, bias=bias)

    def forward(self, x):
        h = self.norm(x)
        return x + self.ffn(h)

    def ffn(self, h):
        return self.down(F.silu(self.gate(h)) * self.up(h))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.q = nn.Linear(H, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(H, HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(H, HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, H, bias=False)

    def forward(self, x):
        return x + self.attend(self.norm(x))

    def attend(self, h):
        b, s, _ = h.shape
        q, k, v = (p(h).view(b, s, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Inner(nn.Module):
    """Wraps a module's inner function so PrepareModuleInput can gather right before the projections."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


def plan_module_input(model: nn.Module, mesh, seq_dim=1) -> nn.Module:
    """torchtitan-style plan: norm sequence-parallel, inputs gathered at the block input, colwise/rowwise."""
    inner = Inner(model.ffn if isinstance(model, MLP) else model.attend)
    model.inner = inner
    model.ffn_or_attn = inner
    cols = ["gate", "up"] if isinstance(model, MLP) else ["q", "k", "v"]
    row = "down" if isinstance(model, MLP) else "o"
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(sequence_dim=seq_dim),
        **{c: ColwiseParallel() for c in cols},
        row: RowwiseParallel(output_layouts=Shard(seq_dim)),
    })
    parallelize_module(inner, mesh, PrepareModuleInput(input_layouts=(Shard(seq_dim),), desired_input_layouts=(Replicate(),)))
    model.forward = lambda x: x + inner(model.norm(x))
    return model


def plan_implicit(model: nn.Module, mesh) -> nn.Module:
    """A plan that leaves the gather to the colwise layers' input redistribution (DTensor end to end)."""
    cols = ["gate", "up"] if isinstance(model, MLP) else ["q", "k", "v"]
    row = "down" if isinstance(model, MLP) else "o"
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(),
        **{c: ColwiseParallel() for c in cols},
        row: RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })
    return model


def seq_sharded(x: torch.Tensor, mesh, dim=1):
    """x is this rank's local shard; returns it as a DTensor sharded on `dim`."""
    return DTensor.from_local(x, mesh, [Shard(dim)])
