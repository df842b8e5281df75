"""kosmos's kernels compile with the options of kosmos.kernels.runtime.COMPILE_OPTIONS at every launch, whatever
triton's defaults: FMA contraction on (triton 3.10 turns its default off)."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

from _sm90 import _source, compile_sm90, ptxas_path

KERNELS = pathlib.Path(__file__).resolve().parent.parent / "kosmos" / "kernels"


def _launches(tree: ast.AST):
    """Every `kernel[grid](...)` and `kernel.warmup(...)` call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (isinstance(node.func, ast.Subscript) or
                                           (isinstance(node.func, ast.Attribute) and node.func.attr == "warmup")):
            yield node


def _kept_launches(tree: ast.AST):
    """Every `launch_plan.launch(...)` call: launch_plan builds and launches those with the options (its own
    `kernel[grid](...)` and `warmup` calls are among the ones scanned)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "launch_plan.launch":
            yield node


def _passes_options(call: ast.Call) -> bool:
    return any(k.arg is None and ast.unparse(k.value) in ("runtime.COMPILE_OPTIONS", "COMPILE_OPTIONS")
               for k in call.keywords)


def test_every_launch_passes_the_compile_options():
    found, missing = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        found += sum(1 for _ in _kept_launches(tree))
        for call in _launches(tree):
            found += 1
            if not _passes_options(call):
                missing.append(f"{path.name}:{call.lineno} {ast.unparse(call.func)}")
    assert found >= 20, found  # the scan still sees the launches
    assert not missing, missing


def test_the_scan_flags_a_launch_without_them():
    bare = ast.parse("k[(1,)](x, BLOCK=64, num_warps=4)\nk[(1,)](x, **meta, **runtime.COMPILE_OPTIONS)")
    assert [_passes_options(c) for c in _launches(bare)] == [False, True]


@pytest.mark.skipif(ptxas_path() is None, reason="triton without its NVIDIA backend (no ptxas)")
def test_contraction_stays_on_when_triton_default_is_off(monkeypatch):
    """With TRITON_DEFAULT_FP_FUSION=0 (triton 3.10's default) a build without the option loses its fused
    multiply-adds; kosmos's options keep them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from kosmos.kernels import moe_rows

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    constexprs = dict(TOP_K=8, HAS_W=True, ROUND_P=False, HAS_ADD=False, BT=8, BH=256)
    pointers = dict(rows="bf16", row="i64", w="fp32", add="bf16", out="bf16")
    fma = re.compile(r"\bfma\.rn\.f32\b")
    kosmos_build = compile_sm90(moe_rows._fold_kernel, constexprs, pointers, num_warps=4, div16=("H",))
    src = _source(ASTSource, moe_rows._fold_kernel, constexprs, pointers, {}, None, div16=("H",))
    default_build = triton_compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))
    assert fma.search(kosmos_build.asm["ptx"])
    assert not fma.search(default_build.asm["ptx"])


@pytest.mark.gpu
def test_launched_fold_keeps_its_bits_when_triton_default_is_off(monkeypatch):
    """On a GPU, the launch path: the weighted fold with fp32 weights (DeepSeek-V3's) gives the same bits under
    TRITON_DEFAULT_FP_FUSION=0 as without it, since its launch pins contraction on; a launch left to that default
    would compile again without fma and round each product apart from the sum."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kosmos.kernels import moe_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    T, k, H = 512, 8, 1024
    rows = torch.randn(T * k, H, device="cuda", dtype=torch.bfloat16, generator=g)
    row = torch.randperm(T * k, device="cuda", generator=g).view(T, k)
    weights = torch.rand(T, k, device="cuda", generator=g)
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    ref = moe_rows.fold(rows, row, weights)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    got = moe_rows.fold(rows, row, weights)
    assert ref.dtype == torch.float32 and torch.equal(got, ref)
