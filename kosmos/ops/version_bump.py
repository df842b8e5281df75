"""A mutable custom op's ADInplaceOrView kernel without torch's per-call walk of the schema.

torch.library.custom_op gives an op with mutates_args a Python ADInplaceOrView kernel that bumps the mutated
arguments' version counters. pytorch#180621 made that kernel first fill every defaulted argument
(`torch._library.utils.fill_defaults`), which reads `schema.arguments` once per argument: quadratic in the argument
count. For kosmos::moe_layer_backward (24 arguments) that took 131-163 us per call on a 2-core CI host, the largest
Python cost of a compiled MoE step there (RESULTS.md, seventy-fourth session). Of the torches kosmos supports only
2.13 has it (pytorch#186175 took it back out; the custom_ops.py of the 2.11.0, 2.12.1 and 2.14.1 wheels never call
fill_defaults). Where torch's kernel walks the schema, the kernel here replaces it, doing what torch's does for a
non-view op (bump, then redispatch past ADInplaceOrView) with the mutated argument's position found once.
"""
from __future__ import annotations

import inspect
import logging
import warnings

import torch

log = logging.getLogger("kosmos")

_libs: list = []  # the registrations live as long as these Library objects


def torch_kernel_walks_schema() -> bool:
    """Whether this torch's custom_op version-bump kernel fills the defaults on every call (read from its source, so
    a nightly between the two pull requests answers right)."""
    try:
        source = inspect.getsource(torch._library.custom_ops)
    except (OSError, TypeError):  # no source shipped: replace it anyway, the kernel here is right either way
        return True
    return "fill_defaults(" in source


def install(op: torch._ops.OpOverload, mutated: str) -> bool:
    """Registers the cheap ADInplaceOrView kernel for `op`, a non-view op that mutates its argument named `mutated`
    (and no other). Returns False, leaving torch's kernel, where this torch has no keyset to redispatch past the key
    or refuses a second Python kernel for it (logged)."""
    schema = op._schema
    names = [a.name for a in schema.arguments]
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if schema._is_view_op() or written != [mutated]:
        raise ValueError(f"kosmos version_bump: {schema.name} must be a non-view op mutating {mutated} alone, "
                         f"it mutates {written}")
    after = getattr(torch._C, "_after_ADInplaceOrView_keyset", None)
    if after is None:
        log.info("kosmos: %s keeps torch's version-bump kernel (no _after_ADInplaceOrView_keyset)", schema.name)
        return False
    index = names.index(mutated)

    def bump(keyset, *args, **kwargs):
        # the dispatcher leaves out trailing arguments equal to their defaults: an omitted one is None, unversioned
        value = args[index] if index < len(args) else kwargs.get(mutated)
        if isinstance(value, torch.Tensor):
            torch.autograd.graph.increment_version(value)
        return op.redispatch(keyset & after, *args, **kwargs)

    namespace, name = schema.name.split("::")
    lib = torch.library.Library(namespace, "FRAGMENT")  # noqa: TOR901
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            # torch 2.11 records custom_op's own kernel as a Python one and refuses a second without allow_override
            lib.impl(name, bump, "ADInplaceOrView", with_keyset=True, allow_override=True)
    except RuntimeError as e:
        lib._destroy()
        log.info("kosmos: %s keeps torch's version-bump kernel (%s)", schema.name, str(e).splitlines()[0])
        return False
    _libs.append(lib)
    return True
