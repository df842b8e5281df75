"""Compiles a kosmos Triton kernel for sm_90 without a GPU (triton's bundled ptxas) and reads ptxas's report."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Optional


def ptxas_path() -> Optional[str]:
    """The ptxas triton runs for sm_90 (its bundled one; from triton 3.9 the CUDA 13 build), or None (a triton
    without the NVIDIA backend)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    path = get_ptxas(90).path
    return path if path and os.path.exists(path) else None


def _source(source_cls, fn, constexprs: dict, pointers: dict, descriptors: dict, descriptor_type, int64=(),
            floats=(), div16=()):
    """The compiler's source for `fn`: signature from the argument names (see compile_sm90); descriptor_type maps
    a descriptor's (dtype, block shape) to its mangled type."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descriptors:
            sig[name] = descriptor_type(*descriptors[name])
        elif name in pointers:
            sig[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in int64:
            sig[name] = "i64"
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    unknown = (set(constexprs) | set(div16)) - set(fn.arg_names)
    if unknown:
        raise ValueError(f"{fn.__name__} has no arguments {sorted(unknown)}")
    return source_cls(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)


def _compile(src, **options):
    """triton.compile for sm_90 with the options every kosmos launch passes (runtime.COMPILE_OPTIONS), so the build
    is the one that runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile

    from kosmos.kernels import runtime

    return triton_compile(src, target=GPUTarget("cuda", 90, 128), options={**runtime.COMPILE_OPTIONS, **options})


def compile_sm90(fn, constexprs: dict, pointers: dict, descriptors: Optional[dict] = None, int64=(), floats=(),
                 num_warps: int = 8, num_stages: int = 3, div16=()):
    """triton.compile of `fn` for sm_90: constexprs by name; pointers name -> element type ("bf16", "i32", ...,
    16-byte aligned as the launchers guarantee); descriptors name -> (dtype, block shape) of a host TMA
    descriptor; int64 / floats: scalar arguments of those types; every other argument an i32, those named in div16
    multiples of 16. Triton's JIT marks every int argument that is a multiple of 16 at the call (and not in
    do_not_specialize) so; without the mark a kernel's masked stores of bf16 tiles come out as one 2-byte STG per
    element and it spills far more (the MoE forward: 6080 against 336 bytes), which is not what runs."""
    import torch
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    def descriptor_type(dtype, block):
        return mangle_type(TensorDescriptor.from_tensor(torch.empty([2] * (len(block) - 2) + [64, 64], dtype=dtype),
                                                        list(block)))

    src = _source(ASTSource, fn, constexprs, pointers, descriptors or {}, descriptor_type, int64, floats, div16)
    return _compile(src, num_warps=num_warps, num_stages=num_stages)


def compile_sm90_gluon(fn, constexprs: dict, pointers: dict, descriptors: dict, num_warps: int = 4):
    """compile_sm90 for a Gluon kernel: descriptors name -> (dtype, block shape), each with the default
    NVMMASharedLayout of its block (what the host launchers build)."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

    def descriptor_type(dtype, block):
        layout = gl.NVMMASharedLayout.get_default_for(list(block), el[dtype])
        return mangle_type(TensorDescriptor.from_tensor(torch.empty(256, 256, dtype=dtype), list(block), layout))

    return _compile(_source(GluonASTSource, fn, constexprs, pointers, descriptors, descriptor_type),
                    num_warps=num_warps)


def ptxas_report(ptx: str) -> dict:
    """ptxas -v of the PTX for sm_90a: registers, spill bytes, and the performance advisories (e.g. wgmma
    serialization, C7510-C7520) as text lines."""
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas_path(), "-arch=sm_90a", "-v", src, "-o", out], capture_output=True, text=True,
                              timeout=600)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{text[-4000:]}")
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_stores=int(spill.group(1)) if spill else 0, spill_loads=int(spill.group(2)) if spill else 0,
                advisories=[ln.strip() for ln in text.splitlines() if "Performance Loss" in ln], text=text)
