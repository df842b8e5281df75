"""Pre-grad pass stage on the Dynamo graph (before AOT autograd): MoE blocks -> kosmos::moe_layer."""
from __future__ import annotations

import torch

from kosmos.options import KosmosOptions
from kosmos.passes import moe, moe_ep_forms


def run(gm: torch.fx.GraphModule, example_inputs, options: KosmosOptions) -> None:
    """Rewrites `gm` in place: whole MoE blocks become one kosmos::moe_layer call; MoE blocks that carry
    their own expert-parallel collectives are reported (not fused yet)."""
    if options.moe:
        moe.run(gm, example_inputs, options)
        moe_ep_forms.run(gm, example_inputs, options)
