"""Post-grad pass stage (forward and backward graphs): TP+SP collective + matmul fusion; backward graphs: kosmos ops
write donated saved tensors in place; graphs without a backward: moe_layer skips the saved up rows nothing reads."""
from __future__ import annotations

import torch

from kosmos.options import KosmosOptions


def graph_kind(graph: torch.fx.Graph) -> str:
    """'backward' for graphs taking tangents, 'forward' for training forwards, else 'inference'."""
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    if any(n.startswith("tangents") for n in names):
        return "backward"
    if any(n.startswith("primals") for n in names):
        return "forward"
    return "inference"


def run(graph: torch.fx.Graph, options: KosmosOptions) -> None:
    kind = graph_kind(graph)
    if options.tp_sp:
        from kosmos.passes import tp_sp

        tp_sp.run(graph, kind, options)
    if kind == "backward":
        from kosmos.passes import donated_inplace

        donated_inplace.run(graph)
    else:
        from kosmos.passes import unused_saved_up

        unused_saved_up.run(graph, kind)
