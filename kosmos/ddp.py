"""DDP under torch.compile: the kosmos pre-grad passes see the whole Dynamo graph before DDPOptimizer splits it.

With a DistributedDataParallel module, Dynamo hands its graph to DDPOptimizer, which cuts it where DDP's gradient
buckets end (about every 25 MB of parameters, walking the graph backwards) and compiles each piece with the
backend. A cut inside an MoE block leaves a router in one piece and its grouped GEMMs in the next, neither
matchable: with real expert weights (tens of MB each) nearly every block is cut, so no block was rewritten. Here
the pre-grad passes run on the whole graph first; DDPOptimizer then places its cuts around the kosmos::moe_layer
calls (one node that takes the router and expert weights), and the pieces compile as before.
"""
from __future__ import annotations

import logging

from torch._dynamo.backends import distributed

log = logging.getLogger("kosmos")


def _kosmos_options(backend):
    """The KosmosOptions of a torch.compile backend wrapper if it is the kosmos backend, else None."""
    from kosmos.backend import disabled, kosmos_backend
    from kosmos.options import KosmosOptions

    if getattr(backend, "compiler_fn", backend) is not kosmos_backend or disabled():
        return None
    return KosmosOptions.from_dict(getattr(backend, "kwargs", {}).get("options"))


class KosmosFirstDDPOptimizer(distributed.DDPOptimizer):
    """DDPOptimizer that runs the kosmos pre-grad passes on the graph before splitting it (kosmos backend only)."""

    def compile_fn(self, gm, example_inputs, **compiler_configs):
        options = _kosmos_options(self.backend_compile_fn)
        if options is not None:
            from kosmos.passes import pre_grad

            pre_grad.run(gm, example_inputs, options)
        return super().compile_fn(gm, example_inputs, **compiler_configs)


def install() -> None:
    """Makes Dynamo use KosmosFirstDDPOptimizer (it looks DDPOptimizer up in this module at each compile);
    other backends get DDPOptimizer's behaviour unchanged."""
    if distributed.DDPOptimizer is not KosmosFirstDDPOptimizer:
        distributed.DDPOptimizer = KosmosFirstDDPOptimizer
        log.debug("kosmos: DDPOptimizer runs the kosmos pre-grad passes before splitting a graph")
