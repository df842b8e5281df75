"""Pre-grad pass stage on the Dynamo graph (before AOT autograd): MoE blocks -> kosmos::moe_layer."""
from __future__ import annotations

import torch

from kosmos.options import KosmosOptions
from kosmos.passes import moe, moe_ep_forms, moe_titan_ep


def run(gm: torch.fx.GraphModule, example_inputs, options: KosmosOptions) -> None:
    """Rewrites `gm` in place: whole MoE blocks (HF's, transformers' AllReduceEP, torchtitan-style all-to-all EP
    traced whole) become one kosmos::moe_layer call; expert-parallel blocks no rewrite took are reported."""
    if options.moe:
        moe_titan_ep.run(gm, example_inputs, options)  # before moe.run: its router / lone-GEMM notes do not apply
        moe.run(gm, example_inputs, options)
        moe_ep_forms.run(gm, example_inputs, options)
