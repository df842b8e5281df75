"""Persistent TMA GEMM (kosmos.kernels.gemm) on a CUDA GPU of compute capability >= 9.0: numerics against a
float64 reference, both B layouts, bias, fp32 with and without TF32, poisoned outputs, bit-identical reruns
over grid sizes, and clear errors for operands TMA cannot take."""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a CUDA GPU with TMA (sm_90+)"),
]

from kosmos.kernels.gemm import CONFIGS, GemmUnsupported, gemm, input_precision, select_config  # noqa: E402


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_operands(M, N, K, dtype, b_trans, a_trans=False, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if a_trans:
        a = torch.randn(K, M, device="cuda", generator=g).to(dtype).t()
    else:
        a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    if b_trans:  # Linear weight [N, K], used as w.t()
        b = torch.randn(N, K, device="cuda", generator=g).to(dtype).t()
    else:
        b = torch.randn(K, N, device="cuda", generator=g).to(dtype)
    c = torch.randn(N, device="cuda", generator=g).to(dtype) if bias else None
    return a, b, c


def reference(a, b, bias):
    ref = a.double() @ b.double()
    return ref + bias.double() if bias is not None else ref


def run_poisoned(a, b, bias, **kw):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
    res = gemm(a, b, bias, out=out, **kw)
    assert res is out
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "output not fully written (NaN poison left)"
    return out


# M, N, K: ragged against every tile size in the table, 16-byte aligned rows for 2-byte types.
SHAPES = [(1000, 520, 776), (257, 1032, 2056), (4096, 1280, 1024), (129, 136, 8), (1, 264, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_trans", [True, False], ids=["w.t()", "kn"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_half_random_shapes(dtype, b_trans, bias):
    for i, (M, N, K) in enumerate(SHAPES):
        a, b, c = make_operands(M, N, K, dtype, b_trans, bias=bias, seed=i)
        out = run_poisoned(a, b, c)
        err = rel_err(out, reference(a, b, c))
        assert err <= 1e-2, (M, N, K, err)
        # the allocating path too
        out2 = gemm(a, b, c)
        assert out2.dtype == dtype and out2.shape == (M, N) and out2.is_contiguous()
        assert torch.equal(out, out2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_trans", [True, False], ids=["w.t()", "kn"])
def test_warp_specialized_random_shapes(dtype, b_trans):
    """The Gluon kernel (producer warp + two ping-pong MMA warpgroups) on ragged shapes, with and without bias."""
    for i, (M, N, K) in enumerate(SHAPES + [(4096, 1280, 5120)]):
        for bias in (False, True):
            a, b, c = make_operands(M, N, K, dtype, b_trans, bias=bias, seed=20 + i)
            out = run_poisoned(a, b, c, config=CONFIGS["ws128"])
            err = rel_err(out, reference(a, b, c))
            assert err <= 1e-2, (M, N, K, bias, err)


def test_warp_specialized_refuses_what_it_cannot_run():
    a, b, c = make_operands(256, 128, 64, torch.float32, b_trans=True, bias=False)
    with pytest.raises(GemmUnsupported, match="bf16 / fp16 only"):
        gemm(a, b, config=CONFIGS["ws128"])
    a, b, c = make_operands(256, 128, 64, torch.bfloat16, b_trans=False, a_trans=True)
    with pytest.raises(GemmUnsupported, match="transposed view"):
        gemm(a, b, config=CONFIGS["ws128"])


def test_transposed_a():
    for i, (M, N, K) in enumerate([(1000, 520, 776), (264, 1032, 2056)]):
        a, b, c = make_operands(M, N, K, torch.bfloat16, b_trans=False, a_trans=True, bias=True, seed=i)
        out = run_poisoned(a, b, c)
        assert rel_err(out, reference(a, b, c)) <= 1e-2


@pytest.mark.parametrize("name", sorted(k for k in CONFIGS if not k.startswith("fp32")))
def test_every_table_config(name):
    M, N, K = 1000, 1288, 1544
    a, b, c = make_operands(M, N, K, torch.bfloat16, b_trans=True, bias=True, seed=3)
    out = run_poisoned(a, b, c, config=CONFIGS[name])
    assert rel_err(out, reference(a, b, c)) <= 1e-2


@pytest.mark.parametrize("b_trans", [True, False], ids=["w.t()", "kn"])
def test_fp32_tf32_switch(b_trans):
    M, N, K = 513, 264, 1032
    a, b, c = make_operands(M, N, K, torch.float32, b_trans, bias=True, seed=5)
    ref = reference(a, b, c)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert input_precision(torch.float32) == "ieee"
        err_ieee = rel_err(run_poisoned(a, b, c), ref)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert input_precision(torch.float32) == "tf32"
        err_tf32 = rel_err(run_poisoned(a, b, c), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert err_ieee <= 1e-5, err_ieee
    assert err_tf32 <= 5e-3, err_tf32
    assert err_tf32 > 10 * err_ieee, (err_tf32, err_ieee)  # TF32 really ran when allowed, and only then


@pytest.mark.parametrize("config", [None, "bn128", "bn256_nested", "ws128", "ws128_1c_sk", "ws128_1c_ht", "ws256_2s"])
def test_bit_identical_over_grid_sizes(config):
    M, N, K = 1536, 1792, 2056
    cfg = CONFIGS[config] if config else select_config(M, N, K, torch.bfloat16)
    a, b, c = make_operands(M, N, K, torch.bfloat16, b_trans=True, bias=True, seed=7)
    first = run_poisoned(a, b, c, config=cfg)
    for programs in (1, 3, 17, 132, 10_000):
        again = run_poisoned(a, b, c, config=cfg, num_programs=programs)
        assert torch.equal(first, again), programs


@pytest.mark.parametrize("config", ["bn256", "ws128_1c_sk", "ws128_1c_ht"])
@pytest.mark.parametrize("M,N,K", [(4096, 1280, 8192), (1000, 1288, 1544), (264, 72, 20000), (4104, 1288, 200),
                                   (900, 2056, 520)])
def test_stream_k_tail(M, N, K, config):
    """Forced tail schedule (ragged last wave spread over every SM: stream-K, or half tiles for a half_tail
    config, where the last half tile may lie wholly past M): same numerics, fully written, grid-free."""
    cfg = CONFIGS[config]
    a, b, c = make_operands(M, N, K, torch.bfloat16, b_trans=True, bias=True, seed=11)
    out = run_poisoned(a, b, c, config=cfg, stream_k=True)
    assert rel_err(out, reference(a, b, c)) <= 1e-2
    for programs in (1, 13):
        assert torch.equal(out, run_poisoned(a, b, c, config=cfg, stream_k=True, num_programs=programs))
    plain = run_poisoned(a, b, c, config=cfg, stream_k=False)
    assert rel_err(plain, reference(a, b, c)) <= 1e-2
    torch.cuda.synchronize()
    from kosmos.kernels.gemm import stream_k_counters

    assert int(stream_k_counters(a.device, 1).abs().sum()) == 0  # the last contributor of each tile reset it


def test_stream_k_tail_in_a_cuda_graph():
    """A captured stream-K GEMM replayed on changing inputs: the arrival counters come back to zero every replay."""
    cfg = CONFIGS["ws128_1c_sk"]
    a, b, c = make_operands(4096, 1280, 2048, torch.bfloat16, b_trans=True, bias=True, seed=13)
    out = torch.empty(4096, 1280, device="cuda", dtype=torch.bfloat16)
    gemm(a, b, c, out=out, config=cfg, stream_k=True)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, b, c, out=out, config=cfg, stream_k=True)
    for i in range(5):
        a.copy_(torch.randn(a.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemm(a, b, c, config=cfg, stream_k=True)), i


def test_clear_errors():
    a = torch.randn(64, 1001, device="cuda", dtype=torch.bfloat16)  # row stride 2002 bytes
    b = torch.randn(1001, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(GemmUnsupported, match="16"):
        gemm(a, b)
    flat = torch.randn(64 * 64 + 1, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(GemmUnsupported, match="aligned"):
        gemm(flat[1:].view(64, 64), torch.randn(64, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(GemmUnsupported, match="N=60"):  # output rows of 120 bytes
        gemm(torch.randn(64, 64, device="cuda", dtype=torch.bfloat16),
             torch.randn(60, 64, device="cuda", dtype=torch.bfloat16).t())
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(GemmUnsupported, match="dtype mismatch"):
        gemm(x, x.half())
    with pytest.raises(GemmUnsupported, match="K mismatch"):
        gemm(x, torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(GemmUnsupported, match="2-D"):
        gemm(x[None], x)
    with pytest.raises(GemmUnsupported, match="unit"):
        gemm(x[::2, ::2], x[:32, :32])
    assert isinstance(GemmUnsupported("x"), ValueError)


def test_degenerate_sizes():
    x = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    assert gemm(x, w).shape == (0, 32)
    a = torch.randn(16, 0, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(0, 32, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(32, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemm(a, b, bias), bias.expand(16, 32))
