"""The grouped GEMM's SwiGLU backward epilogue (grouped_ws_kernel with SWIGLU_BWD,
gemm_ws_host.launch_grouped_mm_swiglu_backward): the MoE backward's d_au = grad_out rows @ down_proj[e] and the
SwiGLU backward of moe_rows.swiglu_rows_backward in one launch.

On the CPU: the SWIGLU_BWD builds for sm_90 of both configs (no spills, no ptxas advisory, within shared memory, the
row kernel's arithmetic), the plain builds without any of it, the launcher's refusals and arguments (launch
caught), the op's choice and its report lines, and moe_math's use of the registered kernel. On an sm_90 GPU: d_h and
act * w bit-identical to the plain kernel's d_au followed by the row kernel, d_w within fp32 reordering of it, rows
outside the groups untouched, the same bits over grid sizes and schedules.
"""
from __future__ import annotations

import re

import pytest
import torch

from _sm90 import compile_sm90, compile_sm90_gluon, ptxas_path, ptxas_report

needs_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="triton without its NVIDIA backend (no ptxas)")
sm90_only = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                               reason="needs an sm_90 GPU (wgmma)")


def _gluon_or_skip():
    from kosmos.kernels import gemm_ws_host

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    return gemm_ws_host


def _build(config: str, m_fastest: bool, claim: bool, b_trans: bool = False, swiglu_bwd: bool = True,
           w: str = "bf16"):
    """grouped_ws_kernel for sm_90 as launch_grouped_mm_swiglu_backward launches it (B = down_proj [E, H, I], N
    contiguous by default)."""
    from kosmos.kernels import gemm_ws_host, grouped_ws

    bm, bn, bk = gemm_ws_host.GROUPED_BLOCK
    cfg = {**gemm_ws_host.GROUPED_CONFIGS[config], "SWIGLU_BWD": swiglu_bwd}
    rows = bm // cfg["NUM_CONSUMERS"]
    return compile_sm90_gluon(grouped_ws.grouped_ws_kernel,
                              dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, B_TRANS=b_trans,
                                   M_FASTEST=m_fastest, CLAIM=claim, **cfg),
                              dict(c_ptr="bf16", ends_ptr="i32", claim_ptr="i32", act_ptr="bf16", src_ptr="bf16",
                                   idx_ptr="i64", h_ptr="bf16", w_ptr=w, dwp_ptr="fp32"),
                              dict(a_desc=(torch.bfloat16, (rows, bk)),
                                   b_desc=(torch.bfloat16, (bn, bk) if b_trans else (bk, bn)),
                                   c_desc=(torch.bfloat16, (rows, bn))),
                              num_warps=cfg["CONSUMER_WARPS"])


def _f32_ops(ptx: str) -> set:
    """The fp32 arithmetic and 16-bit rounding opcodes of a PTX text (what decides d_h's and act * w's bits)."""
    return set(re.findall(r"^\s*(?:@%p\d+\s+)?((?:ex2|div|rcp|sqrt|fma|mul|add|sub|neg)\.[\w.]*f32|cvt\.rn\.bf16\S*)",
                          ptx, re.M))


@needs_ptxas
@pytest.mark.parametrize("config,m_fastest,claim", [("128x256s", True, True), ("128x256", True, False),
                                                    ("128x256", False, False)])
def test_swiglu_backward_builds_for_sm90(config, m_fastest, claim):
    """The builds the op launches (claimed split consumers from 192 rows an expert, else one consumer): no spills,
    no advisory, within shared memory, wgmma, 16-byte stores of d_h and act * w."""
    _gluon_or_skip()
    k = _build(config, m_fastest, claim)
    rep = ptxas_report(k.asm["ptx"])
    assert not rep["advisories"], "\n".join(rep["advisories"])
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["text"]
    assert k.metadata.shared <= 227 * 1024
    ptx = k.asm["ptx"]
    assert "setmaxnreg.dec" in ptx and "wgmma.mma_async" in ptx
    stores = set(re.findall(r"\bst\.global\.(\S+)", ptx))
    assert "v4.b32" in stores and stores <= {"v4.b32", "b32", "f32"}, sorted(stores)
    assert not re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)  # d_au never goes out


@needs_ptxas
def test_swiglu_backward_builds_with_fp32_weights_and_k_contiguous_b():
    """DeepSeek-V3's fp32 routing weights, and a K-contiguous B: the same checks on the claimed split build."""
    _gluon_or_skip()
    for k in (_build("128x256s", True, True, w="fp32"), _build("128x256s", True, True, b_trans=True)):
        rep = ptxas_report(k.asm["ptx"])
        assert not rep["advisories"] and rep["spill_stores"] == 0, rep["text"]
        assert k.metadata.shared <= 227 * 1024


@needs_ptxas
def test_swiglu_backward_arithmetic_is_the_row_kernels():
    """The epilogue takes the instructions moe_rows' backward row kernel takes (ex2.approx, div.full, fma, the
    round-to-nearest 16-bit casts), so the same inputs give the same d_h and act * w; the plain build has none."""
    _gluon_or_skip()
    from kosmos.kernels import moe_rows

    rows = compile_sm90(moe_rows._swiglu_rows_backward_kernel, dict(IN_PLACE=True, ACT_W=True, BR=16, BC=256),
                        dict(h="bf16", d_au="bf16", w="bf16", d_h="bf16", d_w="fp32", act_w="bf16"), num_warps=4,
                        div16=("I",))
    epilogue = _build("128x256s", True, True).asm["ptx"]
    assert _f32_ops(epilogue) == _f32_ops(rows.asm["ptx"]), (_f32_ops(epilogue) ^ _f32_ops(rows.asm["ptx"]))
    assert {"ex2.approx.f32", "div.full.f32"} <= _f32_ops(epilogue)
    plain = _build("128x256s", True, True, swiglu_bwd=False).asm["ptx"]
    assert not re.search(r"ex2\.|div\.full", plain)


# ---------------------------------------------------------------------------------------- host side (no launch)

def _operands(S=300, H=128, I=256, E=3, dtype=torch.bfloat16, w_dtype=torch.bfloat16, device="cpu"):
    """grad_out rows a [S, H], B = down_proj [E, H, I], ends, up rows h [S, 2I], routing weights w [S]."""
    a = torch.zeros(S, H, dtype=dtype, device=device)
    b = torch.zeros(E, H, I, dtype=dtype, device=device)
    ends = torch.tensor([100, 100, 299][:E], dtype=torch.int32, device=device)
    return a, b, ends, torch.zeros(S, 2 * I, dtype=dtype, device=device), torch.zeros(S, dtype=w_dtype, device=device)


def test_swiglu_backward_refusals():
    from kosmos.kernels import gemm_ws_host

    a, b, _, h, w = _operands()
    unsupported = gemm_ws_host.swiglu_backward_unsupported
    assert "multiple of 256" in unsupported(a, _operands(I=128)[1], _operands(I=128)[3], w)
    assert "16-bit up rows" in unsupported(a, b, h.float(), w)
    assert "16-bit up rows" in unsupported(a, b, h, w.to(torch.int32))
    assert "contiguous [S, 2I]" in unsupported(a, b, h[:, :256], w)
    assert "contiguous [S, 2I]" in unsupported(a, b, h[:-1], w)
    assert "contiguous [S, 2I]" in unsupported(a, b, h, w[:-1])
    assert "contiguous [S, 2I]" in unsupported(a, b, torch.zeros(512, 300, dtype=h.dtype).t(), w)
    assert "dtypes" in unsupported(a.float(), b.float(), h, w)
    # operands it takes: the plain kernel's reasons only (on this machine: none on an sm_90 GPU, else the device's)
    assert unsupported(a, b, h, w.float()) == gemm_ws_host.grouped_unsupported(a, b)


def _catch(monkeypatch) -> dict:
    """Replaces grouped_ws.grouped_ws_kernel by a stand-in recording its `[grid](*args, **kwargs)` call."""
    from kosmos.kernels import grouped_ws

    seen = {}

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(grid=grid, args=args, kwargs=kwargs)

    monkeypatch.setattr(grouped_ws, "grouped_ws_kernel", Catch())
    return seen


@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("claim", [False, True])
def test_swiglu_backward_launch_arguments(monkeypatch, config, claim):
    """The launcher's call: every keyword a parameter of the kernel, SWIGLU_BWD on (SWIGLU off), C = act * w [S, I]
    in A's dtype, h / w / a zeroed dwp [S, I / 256] fp32 as the epilogue's pointers; d_w = dwp's row sums. The other
    launchers pass SWIGLU_BWD=False."""
    gemm_ws_host = _gluon_or_skip()
    from kosmos.kernels import grouped_ws, runtime

    names = grouped_ws.grouped_ws_kernel.arg_names
    seen = _catch(monkeypatch)
    a, b, ends, h, w = _operands(I=512)
    act_w, d_w = gemm_ws_host.launch_grouped_mm_swiglu_backward(a, b, ends, h, w, m_fastest=True, claim=claim,
                                                                config=config, programs=5)
    assert act_w.shape == (300, 512) and act_w.dtype == a.dtype and d_w.shape == (300,) and d_w.dtype == torch.float32
    kwargs = dict(seen["kwargs"])
    assert kwargs.pop("num_warps") == gemm_ws_host.GROUPED_CONFIGS[config]["CONSUMER_WARPS"]
    assert {k: kwargs.pop(k, None) for k in runtime.COMPILE_OPTIONS} == runtime.COMPILE_OPTIONS
    assert set(kwargs) <= set(names) and kwargs["SWIGLU_BWD"] is True and kwargs["SWIGLU"] is False
    assert kwargs["CLAIM"] == claim and kwargs["B_TRANS"] is False and seen["grid"] == (5,)
    args = dict(zip(names, seen["args"]))
    rows = gemm_ws_host.GROUPED_BLOCK[0] // kwargs["NUM_CONSUMERS"]
    assert list(args["a_desc"].block_shape) == [rows, 64]
    assert list(args["b_desc"].block_shape) == [64, 256] and list(args["b_desc"].shape) == [3 * 128, 512]
    assert list(args["c_desc"].block_shape) == [rows, 256] and list(args["c_desc"].shape) == [300, 512]
    assert args["c_ptr"] is act_w and args["h_ptr"] is h and args["w_ptr"] is w and args["N"] == 512
    dwp = args["dwp_ptr"]
    assert dwp.shape == (300, 2) and dwp.dtype == torch.float32 and not dwp.any()
    gemm_ws_host.launch_grouped_mm(a, b, ends, programs=5, claim=claim, config=config)
    assert seen["kwargs"]["SWIGLU_BWD"] is False
    gemm_ws_host.launch_grouped_mm_swiglu(a, torch.zeros(3, 512, 128, dtype=a.dtype).transpose(1, 2), ends,
                                          programs=5, claim=claim, config=config)
    assert seen["kwargs"]["SWIGLU_BWD"] is False and seen["kwargs"]["SWIGLU"] is True


def test_swiglu_backward_launch_argument_checks(monkeypatch):
    gemm_ws_host = _gluon_or_skip()
    seen = _catch(monkeypatch)
    a, b, ends, h, w = _operands()
    launch = gemm_ws_host.launch_grouped_mm_swiglu_backward
    with pytest.raises(ValueError, match="ends must be int32"):
        launch(a, b, ends.long(), h, w, programs=5)
    with pytest.raises(ValueError, match="multiple of 256"):
        launch(a, _operands(I=384)[1], ends, _operands(I=384)[3], w, programs=5)
    with pytest.raises(ValueError, match="16-bit up rows"):
        launch(a, b, ends, h.float(), w, programs=5)
    assert not seen
    act_w, d_w = launch(a[:0], b, ends, h[:0], w[:0], programs=5)  # no rows: nothing launched
    assert act_w.shape == (0, 256) and d_w.shape == (0,) and not seen


def test_reference_backward_takes_the_epilogue_where_kosmos_grouped_gemm_runs(monkeypatch):
    """moe_ops.grouped_rows_mm_swiglu_backward (the row kernel "moe_grouped_mm_swiglu_backward"): the epilogue with
    grouped_rows_mm's schedule and config where that runs kosmos's kernel, returning (h as d_h, d_w, act * w); None
    where torch's matmul runs (recorded by grouped_rows_mm itself), for I not a multiple of 256 and with
    KOSMOS_GROUPED_SWIGLU_BWD=0 (both recorded). Meta tensors, launch caught: no GPU."""
    import kosmos
    from kosmos.kernels import gemm_ws_host, moe_ops

    for env in ("KOSMOS_GROUPED_MM", "KOSMOS_GROUPED_CONFIG", "KOSMOS_GROUPED_SWIGLU_BWD"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(gemm_ws_host, "grouped_unsupported", lambda a, b: None)  # as on an sm_90 GPU
    launched = []
    monkeypatch.setattr(gemm_ws_host, "launch_grouped_mm_swiglu_backward",
                        lambda a, b, ends, h, w, **kw: launched.append(kw) or ("act_w", "d_w"))

    def call(S, E, I, H, w_dtype=torch.bfloat16):
        a = torch.empty(S, H, dtype=torch.bfloat16, device="meta")
        b = torch.empty(E, H, I, dtype=torch.bfloat16, device="meta")
        h = torch.empty(S, 2 * I, dtype=torch.bfloat16, device="meta")
        w = torch.empty(S, dtype=w_dtype, device="meta")
        out = moe_ops.grouped_rows_mm_swiglu_backward(a, b, torch.empty(E, dtype=torch.int32, device="meta"), h, w)
        return out if out is None else (out[0] is h, *out[1:])

    kosmos.reset_report()
    assert call(16384 * 8 + 128, 128, 1536, 4096) == (True, "d_w", "act_w")  # Qwen3-235B: claimed, split consumers
    assert call(4096 * 8 + 256, 256, 2048, 7168, torch.float32) == (True, "d_w", "act_w")  # DeepSeek-V3, 129 rows
    assert launched == [dict(m_fastest=True, claim=True, config="128x256s"),
                        dict(m_fastest=True, claim=False, config="128x256")]
    assert call(16384 * 8 + 128, 128, 768, 2048) is None  # Qwen3-30B-A3B: torch's grouped kernel
    assert call(16384 * 8 + 128, 128, 1664, 4096) is None  # I % 256 != 0
    monkeypatch.setenv("KOSMOS_GROUPED_SWIGLU_BWD", "0")
    assert call(16384 * 8 + 128, 128, 1536, 4096) is None
    monkeypatch.setenv("KOSMOS_GROUPED_SWIGLU_BWD", "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        call(16384 * 8 + 128, 128, 1536, 4096)
    runs = kosmos.report().runtime
    assert len(launched) == 2 and set(runs) == {
        ("grouped_mm_swiglu_backward", "kosmos grouped_ws m-fastest claimed 128x256s swiglu backward", "supported"),
        ("grouped_mm_swiglu_backward", "kosmos grouped_ws m-fastest 128x256 swiglu backward", "supported"),
        ("grouped_mm_swiglu_backward", "grouped matmul + SwiGLU backward row kernel",
         "I = 1664 not a multiple of 256 (the epilogue's column tiles)"),
        ("grouped_mm_swiglu_backward", "grouped matmul + SwiGLU backward row kernel", "KOSMOS_GROUPED_SWIGLU_BWD=0")
    }, runs


def test_saved_rows_backward_takes_the_registered_kernel(monkeypatch):
    """moe_math._experts_backward_saved_ asks "moe_grouped_mm_swiglu_backward" (grad_out rows in down_proj's dtype,
    down_proj, the groups' ends, the up rows, the rows' weights) and uses its (d_h, d_w, act * w); a kernel that
    declines leaves the grouped matmul and _swiglu_rows_backward_, whose results the fake's equal."""
    from kosmos.ops import dispatch, moe_math

    torch.manual_seed(0)
    T, k, E, H, I = 6, 2, 3, 8, 4
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]])
    rows = moe_math._SortedPairs(ids, E)
    grad_out, hidden = torch.randn(T, H), torch.randn(T, H)
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    w_rows = rows.gather(torch.rand(T * k), rows.pair)
    h = torch.randn(rows.token.shape[0], 2 * I)

    def plain():
        return moe_math._experts_backward_saved_(grad_out, hidden, rows, w_rows, h.clone(), gate_up, down)

    monkeypatch.setattr(moe_math, "_grouped_kernel", lambda a, b, n: True)  # as the kernel's caller sees it
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: None)
    want = plain()
    asked = []

    def fake(g, b, ends, h_, w):
        asked.append((g, b, ends, h_, w))
        d_au = moe_math._grouped_mm(g, b, rows.groups)
        return moe_math._swiglu_rows_backward_(h_, d_au, w)

    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: fake if name == "moe_grouped_mm_swiglu_backward"
                        else None)
    got = plain()
    (g, b, ends, h_, w), = asked
    assert b is down and ends is rows.groups.ends and w is w_rows and h_.shape == h.shape
    assert torch.equal(g, rows.gather(grad_out, dtype=down.dtype))
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (
        (lambda *args: None) if name == "moe_grouped_mm_swiglu_backward" else None))
    for x, y in zip(plain(), want):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------------- GPU

def _gpu_operands(H, I, sizes, dtype=torch.bfloat16, w_dtype=torch.bfloat16, extra_rows=5, seed=0):
    """grad_out rows a [sum(sizes) + extra_rows, H], B = down_proj [E, H, I], ends, up rows h, weights w."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = sum(sizes) + extra_rows
    a = torch.randn(S, H, device="cuda", generator=g).to(dtype)
    b = (torch.randn(len(sizes), H, I, device="cuda", generator=g) / H ** 0.5).to(dtype)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    h = (3 * torch.randn(S, 2 * I, device="cuda", generator=g)).to(dtype)
    w = torch.rand(S, device="cuda", generator=g).to(w_dtype)
    return a, b, ends, h, w


def _ragged(E: int, rows: int, seed: int) -> list:
    """E group sizes summing to about `rows`, with empty groups, a one-row group and a total not a multiple of 128."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.multinomial(torch.ones(E), rows, replacement=True, generator=g).bincount(minlength=E).tolist()
    sizes[1] = sizes[E // 2] = 0
    sizes[2] = 1
    if sum(sizes) % 128 == 0:
        sizes[3] += 1
    return sizes


def _check(a, b, ends, h, w, rows, **kw):
    """The epilogue against the plain kernel's d_au and the row kernel: d_h and act * w the same bits, d_w within
    fp32 reordering, rows past the groups untouched in h; returns (d_h, d_w, act * w) for more checks."""
    from kosmos.kernels import gemm_ws_host, moe_rows

    assert gemm_ws_host.swiglu_backward_unsupported(a, b, h, w) is None
    plain = {k: v for k, v in kw.items() if k != "programs"}
    act_w_ref = gemm_ws_host.launch_grouped_mm(a, b, ends, programs=kw.get("programs"), **plain)[:rows]  # d_au
    h_ref = h[:rows].clone()
    d_h_ref, d_w_ref = moe_rows.swiglu_rows_backward(h_ref, act_w_ref, w[:rows].contiguous(), in_place=True,
                                                     act_w=act_w_ref)
    d_h = h.clone()
    act_w, d_w = gemm_ws_host.launch_grouped_mm_swiglu_backward(a, b, ends, d_h, w, **kw)
    assert torch.equal(d_h[:rows], d_h_ref), (d_h[:rows] != d_h_ref).nonzero()[:8].tolist()
    assert torch.equal(d_h[rows:], h[rows:])
    assert torch.equal(act_w[:rows], act_w_ref), (act_w[:rows] != act_w_ref).nonzero()[:8].tolist()
    scale = d_w_ref.abs().max().clamp_min(1e-30)
    assert ((d_w[:rows] - d_w_ref).abs().max() / scale).item() <= 1e-5
    assert not d_w[rows:].any()
    return d_h, d_w, act_w


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config,m_fastest,claim", [("128x256s", True, True), ("128x256", True, False),
                                                    ("128x256", False, False), ("128x256s", False, True)])
@pytest.mark.parametrize("H,I,E,rows,w_dtype", [(4096, 1536, 128, 20000, torch.bfloat16),
                                                (7168, 2048, 32, 8000, torch.float32)], ids=["qwen3", "deepseek"])
def test_gpu_swiglu_backward_gives_the_matmul_and_row_kernel_bits(H, I, E, rows, w_dtype, config, m_fastest, claim):
    """Qwen3-235B's expert dims (about 156 rows an expert, bf16 weights) and DeepSeek-V3's (about 250, fp32
    weights), ragged groups with empty ones and a one-row group."""
    sizes = _ragged(E, rows, seed=E)
    a, b, ends, h, w = _gpu_operands(H, I, sizes, w_dtype=w_dtype)
    _check(a, b, ends, h, w, sum(sizes), m_fastest=m_fastest, claim=claim, config=config)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
def test_gpu_swiglu_backward_short_groups_and_grid_sizes(config):
    """Groups shorter than a tile, 63 / 64 / 65 rows in a last tile (the split's lower consumer skipping or not), a
    K not a multiple of 64, few programs: the row kernel's bits, and the same bits (d_w too) on every grid size and
    schedule."""
    sizes = [129, 191, 192, 193, 64, 65, 63, 1, 0, 320, 2, 128]
    a, b, ends, h, w = _gpu_operands(320, 512, sizes, seed=1)
    first = None
    for programs, m_fastest, claim in ((None, False, False), (3, True, False), (5, True, True), (1, False, True)):
        got = _check(a, b, ends, h, w, sum(sizes), programs=programs, m_fastest=m_fastest, claim=claim,
                     config=config)
        first = first or got
        assert all(torch.equal(x[:sum(sizes)], y[:sum(sizes)]) for x, y in zip(got, first))


@pytest.mark.gpu
@sm90_only
def test_gpu_swiglu_backward_fp16_and_k_contiguous_b():
    """fp16 operands with fp32 weights, and B as a K-contiguous view: the row kernel's bits."""
    sizes = _ragged(16, 1500, seed=3)
    a, b, ends, h, w = _gpu_operands(512, 256, sizes, dtype=torch.float16, w_dtype=torch.float32, seed=2)
    _check(a, b, ends, h, w, sum(sizes), m_fastest=True, claim=True, config="128x256s")
    b_t = b.transpose(1, 2).contiguous().transpose(1, 2)
    _check(a, b_t, ends, h, w, sum(sizes), m_fastest=True, claim=True, config="128x256s")
