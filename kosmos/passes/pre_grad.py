"""Pre-grad pass stage on the Dynamo graph (before AOT autograd): MoE blocks -> kosmos::moe_layer."""
from __future__ import annotations

import torch

from kosmos.options import KosmosOptions
from kosmos.passes import moe


def run(gm: torch.fx.GraphModule, example_inputs, options: KosmosOptions) -> None:
    """Rewrites `gm` in place: whole MoE blocks become one kosmos::moe_layer call."""
    if options.moe:
        moe.run(gm, example_inputs, options)
