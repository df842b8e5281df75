"""The `kosmos` torch.compile backend: pre-grad passes on the Dynamo graph, then Inductor
with kosmos post-grad passes."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from kosmos.options import KosmosOptions

log = logging.getLogger("kosmos")

KILL_SWITCH = "KOSMOS_DISABLE"
_PACKAGE = pathlib.Path(__file__).parent


def disabled() -> bool:
    """Whether the kill switch is set: kosmos then leaves every graph to plain Inductor."""
    return os.environ.get(KILL_SWITCH, "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _pass_sources_hash() -> str:
    """Hash of the sources that shape a compiled graph (read once per process: uuid() is asked for on every
    compile): the passes, the options, and the ops (schemas, fake impls and registered autograd decide the backward
    graph that AOT autograd traces: a cached graph of an older kosmos calls the ops with arguments they no longer
    take)."""
    h = hashlib.sha256()
    files = sorted(_PACKAGE.glob("passes/*.py")) + sorted(_PACKAGE.glob("ops/*.py")) + [_PACKAGE / "options.py"]
    for f in files:
        h.update(str(f.relative_to(_PACKAGE)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


class KosmosPostGradPass(CustomGraphPass):
    """Runs the kosmos post-grad passes, then the user's own post-grad pass if there was one."""

    def __init__(self, options: KosmosOptions, user_pass: Any = None):
        self.options = options
        self.user_pass = user_pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        from kosmos.passes import post_grad

        post_grad.run(graph, self.options)
        if self.user_pass is not None:
            self.user_pass(graph)

    def uuid(self) -> Optional[Any]:
        user_uuid = None
        if self.user_pass is not None:
            if not hasattr(self.user_pass, "uuid"):
                return None  # an opaque user pass: Inductor cannot cache either way
            user_uuid = self.user_pass.uuid()
            if user_uuid is None:
                return None
        return json.dumps([_pass_sources_hash(), self.options.key(), repr(user_uuid)])


def kosmos_backend(gm: torch.fx.GraphModule, example_inputs, options: Optional[dict] = None,
                   mode: Optional[str] = None, **kwargs):
    """torch.compile(model, backend="kosmos", options={...}) (see kosmos.options.KosmosOptions) or mode=... (one of
    Inductor's modes, e.g. "reduce-overhead", "max-autotune": their Inductor settings under kosmos's passes)."""
    from torch._inductor.compile_fx import compile_fx

    if kwargs:
        raise TypeError(f"kosmos backend got unexpected arguments {sorted(kwargs)}; settings go in options= or mode=")
    opts = KosmosOptions.from_dict(options)
    if mode is not None:  # torch.compile passes no options= with it; options' own Inductor settings win if both
        opts = dataclasses.replace(opts, inductor_config={**torch._inductor.list_mode_options(mode),
                                                          **opts.inductor_config})
    if disabled():
        log.info("kosmos disabled by %s: compiling with plain Inductor", KILL_SWITCH)
        return compile_fx(gm, example_inputs, config_patches=opts.inductor_config or None)

    from kosmos.passes import pre_grad

    pre_grad.run(gm, example_inputs, opts)
    user_pass = opts.inductor_config.get("post_grad_custom_post_pass",
                                         torch._inductor.config.post_grad_custom_post_pass)
    patches = dict(opts.inductor_config)
    patches["post_grad_custom_post_pass"] = KosmosPostGradPass(opts, user_pass)
    patches["_micro_pipeline_tp"] = False
    return compile_fx(gm, example_inputs, config_patches=patches)


def register() -> None:
    """Registers the backend under the name "kosmos" (idempotent; the entry point does the same after pip install),
    and has DDPOptimizer run the kosmos pre-grad passes before it splits a DDP module's graph (kosmos.ddp)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    from kosmos import ddp

    if "kosmos" not in _BACKENDS or _BACKENDS["kosmos"] is None:
        register_backend(name="kosmos")(kosmos_backend)
    ddp.install()
