"""The reference forward's fp32 router on bf16 hidden states (kosmos.kernels.router_gemm, row kernel
"moe_router_logits"): when the router takes it and what the report records (CPU), and on a GPU its accuracy against
fp64 beside cuBLAS's fp32 GEMM and the routing it gives."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import kosmos
from kosmos.ops import dispatch, moe_math

DEEPSEEK_ROUTER = dict(top_k=8, scoring="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5, router_dtype=torch.float32)


@contextlib.contextmanager
def _allow_tf32(flag: bool):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = flag
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _router(T, H, E, device="cpu", weight_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).bfloat16()
    weight = (torch.randn(E, H, generator=g) / H**0.5).to(weight_dtype)
    bias = torch.rand(E, generator=g) / 10
    return hidden.to(device), weight.to(device), bias.to(device)


def test_route_takes_the_registered_kernel_for_an_fp32_router_on_bf16(monkeypatch):
    """route() asks the row kernel for the logits of an fp32 router on bf16 hidden states and selects from what it
    returns; other routers, and a kernel that declines (None), keep torch's F.linear."""
    hidden, weight, bias = _router(40, 64, 32)
    asked = []

    def kernel(h, w, b):
        asked.append(h.dtype)
        return torch.zeros(h.shape[0], w.shape[0]).index_fill_(1, torch.arange(8) * 4, 1.0)  # experts 0, 4, ... 28

    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: kernel if name == "moe_router_logits" else None)
    logits, ids, _ = moe_math.route(hidden, weight, None, bias * 0, **dict(DEEPSEEK_ROUTER, n_group=1, topk_group=1))
    assert asked == [torch.bfloat16] and torch.equal(logits, kernel(hidden, weight, None))
    assert sorted(ids[0].tolist()) == list(range(0, 32, 4))
    # a 16-bit router (Qwen3's) never asks; a declining kernel leaves torch's GEMM
    moe_math.route(hidden, weight.bfloat16(), None, None, 8, "softmax", True, 1, 1, 1.0, None)
    assert len(asked) == 2  # (the equality check above made the second call)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (lambda h, w, b: None)
                        if name == "moe_router_logits" else None)
    want = F.linear(hidden.float(), weight)
    assert torch.equal(moe_math.route(hidden, weight, None, bias, **DEEPSEEK_ROUTER)[0], want)


def test_router_kernel_reasons(monkeypatch):
    """What router_gemm refuses, and moe_ops' switch: the report records torch's run and the reason."""
    from kosmos.kernels import moe_ops, router_gemm

    hidden, weight, _ = _router(16, 64, 32)
    assert router_gemm.unsupported(hidden, weight, None) is None
    assert "bf16 expected" in router_gemm.unsupported(hidden.half(), weight, None)
    assert "fp32 or bf16 expected" in router_gemm.unsupported(hidden, weight.half(), None)
    assert "does not match" in router_gemm.unsupported(hidden[:, :48], weight, None)
    assert "H % 8" in router_gemm.unsupported(torch.randn(16, 60).bfloat16(), torch.randn(32, 60), None)
    assert "bias" in router_gemm.unsupported(hidden, weight, torch.zeros(31))
    with _allow_tf32(True):
        assert "allow_tf32" in router_gemm.unsupported(hidden, weight, None)
        with pytest.raises(ValueError, match="allow_tf32"):
            router_gemm.router_logits(hidden, weight)
    kosmos.reset_report()
    monkeypatch.setenv("KOSMOS_ROUTER_GEMM", "torch")
    assert moe_ops.router_rows_logits(hidden, weight, None) is None
    assert kosmos.report().runtime == {("router_logits", "torch fp32 linear", "KOSMOS_ROUTER_GEMM=torch"): 1}
    monkeypatch.setenv("KOSMOS_ROUTER_GEMM", "yes")
    with pytest.raises(ValueError, match="expected auto or torch"):
        moe_ops.router_rows_logits(hidden, weight, None)


def test_router_tile_config_by_tokens(monkeypatch):
    """128-token tiles where they fill half of the SMs or more (the H200's 132 at DeepSeek-V3's 256 experts: from
    T = 8192), 64-token ones below."""
    from kosmos.kernels import router_gemm, runtime

    monkeypatch.setattr(runtime, "num_sms", lambda device: 132)
    got = {T: router_gemm.config(T, 256, torch.device("cuda")) for T in (1, 4096, 8192, 16384)}
    wide, narrow = router_gemm.CONFIGS["wide"], router_gemm.CONFIGS["narrow"]
    assert got == {1: narrow, 4096: narrow, 8192: wide, 16384: wide}


def _max_rel(got, want64):
    return ((got.double() - want64).abs().max() / want64.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs an sm_90 GPU (TMA, wgmma)")
@pytest.mark.parametrize("T,weight_dtype", [(4096, torch.float32), (1000, torch.float32), (77, torch.bfloat16)])
def test_gpu_reference_router_kernel_is_fp32_accurate(monkeypatch, T, weight_dtype):
    """DeepSeek-V3's router (H 7168, E 256; T not a multiple of the 128-token tile, a bf16 weight too): the kernel's
    logits are as close to the fp64 product as cuBLAS's fp32 GEMM's (in its order of error), and the
    reference router picks the same experts with them but for near-ties."""
    with _allow_tf32(False):
        _check_gpu_router(monkeypatch, T, weight_dtype)


def _check_gpu_router(monkeypatch, T, weight_dtype):
    from kosmos.kernels import router_gemm

    hidden, weight, bias = _router(T, 7168, 256, "cuda", weight_dtype, seed=T)
    want = hidden.double() @ weight.double().T
    got = router_gemm.router_logits(hidden, weight)
    cublas = F.linear(hidden.float(), weight.float())
    err, err_cublas = _max_rel(got, want), _max_rel(cublas, want)
    print(f"T={T} {weight_dtype}: kernel {err:.3g}, cuBLAS fp32 {err_cublas:.3g}")
    assert got.dtype == torch.float32 and got.shape == (T, 256)
    # the same order as cuBLAS's fp32 error (0.25-1.4e-6 here, by the shape): a bf16 or TF32 GEMM is ~1e-3 off
    assert err <= max(2 * err_cublas, 1e-6), (err, err_cublas)
    assert torch.equal(router_gemm.router_logits(hidden, weight), got)  # the same bits on a rerun
    with_bias = router_gemm.router_logits(hidden, weight, bias)
    assert _max_rel(with_bias, want + bias.double()) <= max(2 * err_cublas, 1e-6)

    import kosmos.kernels.fused_ops  # noqa: F401  (registers the row kernels)

    kosmos.reset_report()
    monkeypatch.delenv("KOSMOS_ROUTER_GEMM", raising=False)
    logits, ids, weights = moe_math.route(hidden, weight, None, bias, **DEEPSEEK_ROUTER)
    assert kosmos.report().runtime.get(("router_logits", "kosmos router_gemm",
                                        "fp32 router on bf16 hidden states, TF32 off")) == 1
    monkeypatch.setenv("KOSMOS_ROUTER_GEMM", "torch")
    t_logits, t_ids, t_weights = moe_math.route(hidden, weight, None, bias, **DEEPSEEK_ROUTER)
    assert _max_rel(logits, want) <= max(2 * err_cublas, 1e-6) and torch.allclose(logits, t_logits, rtol=0, atol=1e-5)
    same = (ids.sort(1)[0] == t_ids.sort(1)[0]).all(1)
    assert same.float().mean() >= 0.99, same.float().mean()  # top-k near-ties may go either way
    assert torch.allclose(weights[same], t_weights[same], rtol=1e-5, atol=1e-6)
