"""Pre-grad pass stage on the Dynamo graph (before AOT autograd): MoE blocks -> kosmos::moe_layer."""
from __future__ import annotations

import torch

from kosmos.options import KosmosOptions


def run(gm: torch.fx.GraphModule, example_inputs, options: KosmosOptions) -> None:
    """Rewrites `gm` in place. The MoE matcher lands here (issue: MoE layer)."""
    return None
