"""Persistent GEMM (kosmos.kernels.gemm) on the CPU: the whole kernel (tile helper, grouped order, epilogue,
host-side TMA descriptors) under TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton
is imported, and must not leak into other test modules), plus the pure-Python pieces in-process.

The interpreter multiplies bf16 raw bits in tl.dot, so only fp16 and fp32 run there."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _interp import REPO, interpreter_env

from kosmos.kernels.gemm import (CONFIGS, GemmConfig, GemmUnsupported, gemm, input_precision, plan_gemm,
                                 select_config)


INTERPRETED = textwrap.dedent("""
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    from _interp import mend_interpreter
    from kosmos.kernels.gemm import GemmConfig, GemmUnsupported, gemm

    def rel_err(out, ref):
        return ((out.double() - ref).norm() / ref.norm()).item()

    mend_interpreter()
    torch.manual_seed(0)
    configs = [GemmConfig(32, 32, 16, num_stages=2, num_warps=4),
               GemmConfig(32, 64, 16, num_stages=2, num_warps=4, group_m=2, epilogue_subtile=False, flatten=False)]
    checked = 0
    for cfg in configs:
        for dtype, tol in ((torch.float16, 1e-3), (torch.float32, 1e-5)):
            for M, N, K in ((72, 40, 56), (104, 136, 8), (1, 24, 40)):
                for a_trans in (False, True):
                    for b_trans in (False, True):
                        for with_bias in (False, True):
                            a = torch.randn(K, M).to(dtype).t() if a_trans else torch.randn(M, K).to(dtype)
                            b = torch.randn(N, K).to(dtype).t() if b_trans else torch.randn(K, N).to(dtype)
                            bias = torch.randn(N).to(dtype) if with_bias else None
                            ref = a.double() @ b.double() + (bias.double() if with_bias else 0)
                            out = torch.full((M, N), float("nan"), dtype=dtype)
                            gemm(a, b, bias, out=out, config=cfg)
                            assert torch.isfinite(out).all(), (cfg, dtype, M, N, K)
                            err = rel_err(out, ref)
                            assert err <= tol, (cfg.name, dtype, M, N, K, a_trans, b_trans, with_bias, err)
                            for programs in (1, 5):
                                again = gemm(a, b, bias, config=cfg, num_programs=programs)
                                assert torch.equal(again, out), (cfg.name, programs)
                            checked += 1
    # alignment errors need the TMA path, reachable on CPU tensors only when interpreting
    x = torch.randn(16, 1001, dtype=torch.float16)
    try:
        gemm(x, torch.randn(1001, 16, dtype=torch.float16))
        raise SystemExit("unaligned stride accepted")
    except GemmUnsupported as e:
        assert "16" in str(e), e
    flat = torch.randn(16 * 16 + 1, dtype=torch.float16)
    try:
        gemm(flat[1:].view(16, 16), torch.randn(16, 16, dtype=torch.float16))
        raise SystemExit("unaligned pointer accepted")
    except GemmUnsupported as e:
        assert "aligned" in str(e), e
    # stream-K tail (the interpreter counts 4 SMs): ragged last wave, and fewer tiles than workers
    cfg = GemmConfig(32, 32, 16, num_stages=2, num_warps=4)
    for M, N, K in ((72, 40, 160), (40, 24, 200), (136, 72, 88)):
        for dtype, tol in ((torch.float16, 1e-3), (torch.float32, 1e-5)):
            a, b = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype).t()
            bias = torch.randn(N).to(dtype)
            ref = a.double() @ b.double() + bias.double()
            out = torch.full((M, N), float("nan"), dtype=dtype)
            gemm(a, b, bias, out=out, config=cfg, stream_k=True)
            assert torch.isfinite(out).all(), (M, N, K)
            assert rel_err(out, ref) <= tol, (M, N, K, rel_err(out, ref))
            for programs in (1, 3):
                assert torch.equal(gemm(a, b, bias, config=cfg, stream_k=True, num_programs=programs), out)
            checked += 1
    print("INTERPRETED_OK", checked)
""")


def test_kernel_under_interpreter():
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=interpreter_env(), cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "INTERPRETED_OK 102" in proc.stdout, proc.stdout[-2000:]


def test_input_precision_follows_allow_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert input_precision(torch.float32) == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert input_precision(torch.float32) == "ieee"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert input_precision(torch.bfloat16) == "bf16"
    assert input_precision(torch.float16) == "fp16"
    with pytest.raises(GemmUnsupported):
        input_precision(torch.int8)


def test_select_config_fits_shared_memory():
    # every config the table can return keeps its pipeline + store buffer under Hopper's 227 KiB
    for M in (1, 4096, 32768):
        for N in (8, 1280, 2560, 5120, 6400, 7168, 8192, 12800, 14336, 57344):
            for K in (8, 1024, 2048, 3200, 3584, 5120, 6400, 7168, 8192, 28672):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    cfg = select_config(M, N, K, dtype)
                    assert isinstance(cfg, GemmConfig)
                    size = dtype.itemsize
                    smem = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * size
                    smem += cfg.block_m * cfg.block_n * size // (2 if cfg.epilogue_subtile else 1)
                    assert smem <= 227 * 1024, (cfg.name, dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert select_config(4096, 4096, 4096, torch.float32) is CONFIGS["fp32"]
        torch.backends.cuda.matmul.allow_tf32 = False
        assert select_config(4096, 4096, 4096, torch.float32) is CONFIGS["fp32_ieee"]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_plan_covers_every_k_block_once():
    cfg = CONFIGS["bn256"]
    for M, N, K in ((4096, 1280, 8192), (8192, 1280, 5120), (4096, 6400, 5120), (1536, 1792, 2056),
                    (4096, 8192, 1024), (32768, 14336, 8192), (100, 100, 100000)):
        for force in (None, True):
            plan = plan_gemm(M, N, K, cfg, 132, force_stream_k=force)
            assert plan.tiles == plan.dp_tiles + plan.sk_tiles
            if not plan.sk_tiles:
                continue
            # the workers' ranges tile the stream exactly; no tile has more contributors than slots
            total = plan.sk_tiles * plan.k_tiles
            assert plan.sk_workers <= 132 and (plan.sk_workers - 1) * plan.sk_iters < total <= \
                plan.sk_workers * plan.sk_iters
            for t in range(plan.sk_tiles):
                first = t * plan.k_tiles // plan.sk_iters
                last = ((t + 1) * plan.k_tiles - 1) // plan.sk_iters
                assert last - first + 1 <= plan.sk_max_contrib
    # the ragged small-N shapes take the tail, the many-wave ones do not
    assert plan_gemm(4096, 1280, 8192, cfg, 132).sk_tiles == 28
    assert plan_gemm(32768, 14336, 8192, cfg, 132).sk_tiles == 0
    assert plan_gemm(4096, 1280, 8192, cfg, 132, force_stream_k=False).sk_tiles == 0
    assert plan_gemm(4096, 1280, 8192, CONFIGS["bn256_nested"], 1).sk_tiles == 0


def test_errors_before_any_device_work():
    x = torch.randn(8, 8)
    with pytest.raises(GemmUnsupported, match="dtype mismatch"):
        gemm(x, x.half())
    with pytest.raises(GemmUnsupported, match="int64"):
        gemm(x.long(), x.long())
    with pytest.raises(GemmUnsupported, match="K mismatch"):
        gemm(x, torch.randn(4, 8))
    with pytest.raises(GemmUnsupported, match="2-D"):
        gemm(x[None], x)
    with pytest.raises(GemmUnsupported, match="bias"):
        gemm(x, x, torch.randn(7))
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        with pytest.raises(GemmUnsupported, match="CUDA"):
            gemm(x, x)
    assert isinstance(GemmUnsupported("x"), ValueError)


def test_warp_specialized_config_says_why_it_cannot_run_here():
    from kosmos.kernels.gemm import GemmLayout, ws_unsupported
    from kosmos.kernels.gemm_ws_host import gluon_missing

    assert gluon_missing() is None  # the pinned triton has the Gluon API gemm_ws.py is written against
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    lay = GemmLayout(64, 64, 64, a_lead=64, b_trans=True, b_lead=64)
    assert "bf16 / fp16 only" in ws_unsupported(x.float(), lay)
    assert "transposed view" in ws_unsupported(x, GemmLayout(64, 64, 64, a_trans=True, a_lead=64))
    reason = ws_unsupported(x, lay)
    assert reason is not None and ("sm_90" in reason or "interpreter" in reason)
    # the warp-specialized kernel keeps its stage ring and a store buffer per consumer (of its rows of a tile, with
    # ws_split) under Hopper's 227 KiB
    for name, cfg in CONFIGS.items():
        if cfg.kernel == "ws":
            store_rows = cfg.block_m // 2 if cfg.ws_split else cfg.block_m
            smem = (cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * 2
                    + cfg.ws_consumers * store_rows * cfg.block_n * 2)
            assert smem <= 227 * 1024, name


def test_plain_gemm_table():
    from kosmos.kernels.gemm import plain_gemm_config, plan_gemm

    # one wave and a bit of 128x256 tiles (M=4096, N=1280): 128x128 tiles fill the waves better, and their
    # ragged third wave (56 tiles) runs as 112 half tiles
    cfg = plain_gemm_config(4096, 1280, 5120, torch.bfloat16)
    assert cfg is CONFIGS["ws128_1c_ht"]
    assert plan_gemm(4096, 1280, 5120, cfg, 132).half_tiles == 56
    # a ragged wave of more than half the SMs stays whole (two rounds of half tiles would be slower)
    assert plan_gemm(8192, 1280, 5120, cfg, 132).half_tiles == 0
    assert plain_gemm_config(8192, 2560, 5120, torch.bfloat16) is CONFIGS["ws256_1c"]
    assert plain_gemm_config(32768, 14336, 8192, torch.float16) is CONFIGS["ws256_1c"]
    # fp32, or no warp-specialized kernel here: the Triton table
    assert plain_gemm_config(4096, 1280, 5120, torch.float32) is select_config(4096, 1280, 5120, torch.float32)
    assert plain_gemm_config(4096, 1280, 5120, torch.bfloat16, ws_unavailable="no gluon") is CONFIGS["bn256"]
