"""Pre-grad pass stage on the Dynamo graph (before AOT autograd): MoE blocks -> kosmos::moe_layer; embeddings ->
kosmos::embedding."""
from __future__ import annotations

import operator

import torch

from kosmos.options import KosmosOptions
from kosmos.passes import embedding, moe, moe_ep_forms, moe_titan_ep


def run(gm: torch.fx.GraphModule, example_inputs, options: KosmosOptions) -> None:
    """Rewrites `gm` in place: whole MoE blocks (HF's, transformers' AllReduceEP, torchtitan-style all-to-all EP
    traced whole) become one kosmos::moe_layer call; expert-parallel blocks no rewrite took are reported;
    embeddings whose weight trains become kosmos::embedding (its backward aten's kernel)."""
    for g in _graph_modules(gm):
        if options.moe:
            if _drop_dead_getitems(g.graph):
                g.recompile()
            moe_titan_ep.run(g, example_inputs, options)  # before moe.run: its router / lone-GEMM notes do not apply
            moe.run(g, example_inputs, options)
            moe_ep_forms.run(g, example_inputs, options)
        if options.aten_embedding_backward:
            embedding.run(g)


def _graph_modules(gm: torch.fx.GraphModule) -> list:
    """gm and the subgraphs of its higher-order ops (e.g. the bodies of torch.utils.checkpoint regions, which
    Dynamo traces as tag_activation_checkpoint(wrap_body_N, ...): HF's gradient_checkpointing puts every decoder
    layer, MoE block included, in one), depth first."""
    out = [gm]
    for child in gm.children():
        if isinstance(child, torch.fx.GraphModule):
            out += _graph_modules(child)
    return out


def _drop_dead_getitems(graph: torch.fx.Graph) -> int:
    """Erases unused getitem nodes (Dynamo leaves them in higher-order ops' bodies, e.g. topk's unused half), which
    would count as uses of a block's intermediates outside the block; returns how many."""
    dropped = 0
    for node in reversed(graph.nodes):  # last first: a getitem of a dropped getitem is dropped too
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            graph.erase_node(node)
            dropped += 1
    return dropped
