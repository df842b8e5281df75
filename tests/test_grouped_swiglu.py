"""The grouped GEMM's SwiGLU epilogue (grouped_ws_kernel with SWIGLU, gemm_ws_host.launch_grouped_mm_swiglu).

On the CPU: the SWIGLU builds for sm_90 of every config the host launches (no spills, no ptxas advisory, within
shared memory, 16-byte stores, the row kernel's act arithmetic; the plain builds' code was checked unchanged by the
option when it was written, RESULTS.md thirty-ninth session), and the launcher's refusals and arguments (launch
caught). On an sm_90 GPU: h and act bit-identical to the plain
kernel's h followed by moe_rows.swiglu_rows, at Qwen3-235B-like and DeepSeek-V3-like sizes.
"""
from __future__ import annotations

import functools
import re

import pytest
import torch

from _sm90 import compile_sm90, compile_sm90_gluon, ptxas_path, ptxas_report

needs_ptxas = pytest.mark.skipif(ptxas_path() is None, reason="triton without its NVIDIA backend (no ptxas)")
sm90_only = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                               reason="needs an sm_90 GPU (wgmma)")

SCHEDULES = [(False, False), (True, False), (True, True), (False, True)]  # (m_fastest, claim)


def _gluon_or_skip():
    from kosmos.kernels import gemm_ws_host

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    return gemm_ws_host


def _build(config: str, m_fastest: bool, claim: bool, b_trans: bool = True, swiglu: bool = False,
           act: str = "bf16", gather: bool = False):
    """grouped_ws_kernel for sm_90 with the constexprs and descriptor blocks its launchers give it (act_ptr: the
    plain launcher's C, or the act tensor; gather: launch_grouped_mm_swiglu's rows given)."""
    from kosmos.kernels import gemm_ws_host, grouped_ws

    bm, bn, bk = gemm_ws_host.GROUPED_BLOCK
    cfg = {**gemm_ws_host.GROUPED_CONFIGS[config], "SWIGLU": swiglu}
    if gather:
        cfg.update(GATHER=True, PRODUCER_REGS=gemm_ws_host.GATHER_PRODUCER_REGS)
    rows = bm // cfg["NUM_CONSUMERS"]
    cols = bn // 2 if swiglu else bn
    return compile_sm90_gluon(grouped_ws.grouped_ws_kernel,
                              dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, B_TRANS=b_trans,
                                   M_FASTEST=m_fastest, CLAIM=claim, **cfg),
                              dict(c_ptr="bf16", ends_ptr="i32", claim_ptr="i32", act_ptr=act, src_ptr="bf16",
                                   idx_ptr="i64"),
                              dict(a_desc=(torch.bfloat16, (rows, bk)),
                                   b_desc=(torch.bfloat16, (cols, bk) if b_trans else (bk, cols)),
                                   c_desc=(torch.bfloat16, (rows, cols))),
                              num_warps=cfg["CONSUMER_WARPS"])


def _f32_ops(ptx: str) -> set:
    """The fp32 arithmetic and bf16 rounding opcodes of a PTX text (what decides act's bits)."""
    return set(re.findall(r"^\s*(?:@%p\d+\s+)?((?:ex2|div|rcp|sqrt|fma|mul|add|sub|neg)\.[\w.]*f32|cvt\.rn\.bf16\S*)",
                          ptx, re.M))


@needs_ptxas
@pytest.mark.parametrize("m_fastest,claim", SCHEDULES, ids=lambda v: str(v))
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
def test_swiglu_builds_for_sm90(config, m_fastest, claim):
    """SWIGLU builds of every config and schedule: no spills, no advisory, within shared memory; the gate / up halves
    as two TMA loads a stage and two TMA stores a tile, 16-byte global stores only (act, a group's last rows)."""
    _gluon_or_skip()
    k = _build(config, m_fastest, claim, swiglu=True)
    rep = ptxas_report(k.asm["ptx"])
    assert not rep["advisories"], "\n".join(rep["advisories"])
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["text"]
    assert k.metadata.shared <= 227 * 1024
    ptx = k.asm["ptx"]
    assert "setmaxnreg.dec" in ptx and "wgmma.mma_async" in ptx
    consumers = 2 if config == "128x256s" else 1
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)) == 2 * consumers
    # the loads' destination is shared::cluster in triton 3.6's PTX, shared::cta in 3.8's
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx)) == consumers + 2
    stores = re.findall(r"\bst\.global\.(\S+)", ptx)
    assert stores and set(stores) == {"v4.b32"}, sorted(set(stores))


@needs_ptxas
@pytest.mark.parametrize("act", ["fp32", "fp16"])
def test_swiglu_builds_with_wider_or_other_act(act):
    """act in fp32 / fp16 (launch_grouped_mm_swiglu's act_dtype): the same checks, on the claimed split build."""
    _gluon_or_skip()
    k = _build("128x256s", True, True, swiglu=True, act=act)
    rep = ptxas_report(k.asm["ptx"])
    assert not rep["advisories"] and rep["spill_stores"] == 0, rep["text"]
    assert k.metadata.shared <= 227 * 1024


@needs_ptxas
def test_swiglu_act_arithmetic_is_the_row_kernels():
    """The epilogue's act takes the instructions moe_rows.swiglu_rows' kernel takes (ex2.approx, div.full, the
    round-to-nearest bf16 casts), so the same inputs give the same bits; the plain build has none of them."""
    _gluon_or_skip()
    from kosmos.kernels import moe_rows

    rows = compile_sm90(moe_rows._swiglu_rows_kernel, dict(BR=64, BC=256), dict(h="bf16", act="bf16"), num_warps=4,
                        div16=("I",))
    epilogue = _build("128x256", False, False, swiglu=True).asm["ptx"]
    assert _f32_ops(epilogue) == _f32_ops(rows.asm["ptx"]), (_f32_ops(epilogue), _f32_ops(rows.asm["ptx"]))
    assert {"ex2.approx.f32", "div.full.f32"} <= _f32_ops(epilogue)
    plain = _build("128x256", False, False).asm["ptx"]
    assert not re.search(r"ex2\.|div\.full|ld\.shared\.v4", plain)


# ---------------------------------------------------------------------------------------- host side (no launch)

def _operands(S=300, H=128, I=256, E=3, dtype=torch.bfloat16, device="cpu"):
    a = torch.zeros(S, H, dtype=dtype, device=device)
    b = torch.zeros(E, 2 * I, H, dtype=dtype, device=device).transpose(1, 2)  # gate_up_proj [E, 2I, H] as B
    ends = torch.tensor([100, 100, 299][:E], dtype=torch.int32, device=device)
    return a, b, ends


def test_swiglu_refusals():
    from kosmos.kernels import gemm_ws_host

    a, b, _ = _operands()
    assert "multiple of 128" in gemm_ws_host.swiglu_unsupported(a, _operands(I=192)[1])
    assert "multiple of 128" in gemm_ws_host.swiglu_unsupported(a, torch.zeros(3, 128, 511, dtype=torch.bfloat16))
    assert "dtypes" in gemm_ws_host.swiglu_unsupported(a.float(), b.float())
    assert "dtypes" in gemm_ws_host.swiglu_unsupported(a, b.half())
    assert "N contiguous" in gemm_ws_host.swiglu_unsupported(a, b.contiguous())
    # operands it takes: the plain kernel's reasons only (on this machine: none on an sm_90 GPU, else the device's)
    assert gemm_ws_host.swiglu_unsupported(a, b) == gemm_ws_host.grouped_unsupported(a, b)


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
def test_swiglu_launch_arguments(monkeypatch, config, claim):
    """launch_grouped_mm_swiglu's call: every keyword a parameter of the kernel, SWIGLU on, half-width B and C
    blocks, h [S, 2I] and act [S, I] (act_dtype) the kernel's C and act; launch_grouped_mm passes SWIGLU=False."""
    gemm_ws_host = _gluon_or_skip()
    from kosmos.kernels import grouped_ws, runtime

    names = grouped_ws.grouped_ws_kernel.arg_names
    seen = _catch(monkeypatch)
    a, b, ends = _operands()
    h, act = gemm_ws_host.launch_grouped_mm_swiglu(a, b, ends, m_fastest=True, claim=claim, config=config,
                                                   act_dtype=torch.float32, programs=5)
    assert h.shape == (300, 512) and h.dtype == a.dtype and act.shape == (300, 256) and act.dtype == torch.float32
    kwargs = dict(seen["kwargs"])
    assert kwargs.pop("num_warps") == gemm_ws_host.GROUPED_CONFIGS[config]["CONSUMER_WARPS"]
    assert {k: kwargs.pop(k, None) for k in runtime.COMPILE_OPTIONS} == runtime.COMPILE_OPTIONS
    assert set(kwargs) <= set(names) and kwargs["SWIGLU"] is True and kwargs["CLAIM"] == claim
    assert seen["grid"] == (5,)
    args = dict(zip(names, seen["args"]))
    rows = gemm_ws_host.GROUPED_BLOCK[0] // kwargs["NUM_CONSUMERS"]
    assert list(args["a_desc"].block_shape) == [rows, 64]
    assert list(args["b_desc"].block_shape) == [128, 64] and list(args["b_desc"].shape) == [3 * 512, 128]
    assert list(args["c_desc"].block_shape) == [rows, 128] and list(args["c_desc"].shape) == [300, 512]
    assert args["c_ptr"] is h and args["act_ptr"] is act and args["N"] == 512
    gemm_ws_host.launch_grouped_mm(a, b, ends, programs=5, claim=claim, config=config)
    assert seen["kwargs"]["SWIGLU"] is False


def test_swiglu_launch_argument_checks(monkeypatch):
    gemm_ws_host = _gluon_or_skip()
    seen = _catch(monkeypatch)
    a, b, ends = _operands()
    launch = gemm_ws_host.launch_grouped_mm_swiglu
    with pytest.raises(ValueError, match="ends must be int32"):
        launch(a, b, ends.long(), programs=5)
    with pytest.raises(ValueError, match="ends must be int32"):
        launch(a, b, ends[:2], programs=5)
    with pytest.raises(ValueError, match="multiple of 128"):
        launch(a, _operands(I=192)[1], ends, programs=5)
    with pytest.raises(ValueError, match="K-contiguous"):
        launch(a, b.contiguous(), ends, programs=5)
    with pytest.raises(ValueError, match="act_dtype"):
        launch(a, b, ends, act_dtype=torch.int8, programs=5)
    assert not seen
    h, act = launch(a[:0], b, ends, programs=5)  # no rows: nothing launched
    assert h.shape == (0, 512) and act.shape == (0, 256) and act.dtype == a.dtype and not seen


def test_reference_forward_takes_the_epilogue_where_kosmos_grouped_gemm_runs(monkeypatch):
    """moe_ops.grouped_rows_mm_swiglu (the row kernel "moe_grouped_mm_swiglu"): the epilogue with grouped_rows_mm's
    schedule and config where that runs kosmos's kernel; None where torch's matmul runs (recorded once, by
    grouped_rows_mm itself), for I not a multiple of 128 and with KOSMOS_GROUPED_SWIGLU=0 (both recorded). Meta
    tensors, launch caught: no GPU."""
    import kosmos
    from kosmos.kernels import gemm_ws_host, moe_ops

    for env in ("KOSMOS_GROUPED_MM", "KOSMOS_GROUPED_CONFIG", "KOSMOS_GROUPED_SWIGLU"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(gemm_ws_host, "grouped_unsupported", lambda a, b: None)  # as on an sm_90 GPU
    launched = []
    monkeypatch.setattr(gemm_ws_host, "launch_grouped_mm_swiglu",
                        lambda a, b, ends, **kw: launched.append(kw) or ("h", "act"))

    def call(S, E, I, H):
        a = torch.empty(S, H, dtype=torch.bfloat16, device="meta")
        b = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        return moe_ops.grouped_rows_mm_swiglu(a, b, torch.empty(E, dtype=torch.int32, device="meta"), torch.bfloat16)

    kosmos.reset_report()
    assert call(16384 * 8 + 128, 128, 1536, 4096) == ("h", "act")  # Qwen3-235B: claimed tiles, split consumers
    assert launched == [dict(m_fastest=True, claim=True, config="128x256s", act_dtype=torch.bfloat16)]
    assert call(16384 * 8 + 128, 128, 768, 2048) is None  # Qwen3-30B-A3B: torch's grouped kernel
    assert call(4096 * 8 + 256, 256, 1600, 7168) is None  # a wide expert, I % 128 != 0
    monkeypatch.setenv("KOSMOS_GROUPED_SWIGLU", "0")
    assert call(16384 * 8 + 128, 128, 1536, 4096) is None
    monkeypatch.setenv("KOSMOS_GROUPED_SWIGLU", "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        call(16384 * 8 + 128, 128, 1536, 4096)
    runs = kosmos.report().runtime
    assert len(launched) == 1 and set(runs) == {
        ("grouped_mm_swiglu", "kosmos grouped_ws m-fastest claimed 128x256s swiglu", "supported"),
        ("grouped_mm_swiglu", "grouped matmul + SwiGLU row kernel",
         "N = 3200 is not 2I with I a multiple of 128 (a tile's column block of gate and of up)"),
        ("grouped_mm_swiglu", "grouped matmul + SwiGLU row kernel", "KOSMOS_GROUPED_SWIGLU=0")}, runs


def test_experts_up_act_takes_the_registered_kernel(monkeypatch):
    """moe_math._experts_up_act asks the "moe_grouped_mm_swiglu" kernel (B = gate_up_proj transposed, the groups'
    ends, the act dtype) and returns its pair; a kernel that declines leaves the grouped matmul and _act."""
    from kosmos.ops import dispatch, moe_math

    x = torch.randn(10, 16)
    gate_up = torch.randn(2, 2 * 8, 16)
    groups = moe_math._Groups(torch.tensor([4, 10], dtype=torch.int32))
    asked = []
    monkeypatch.setattr(moe_math, "_grouped_kernel", lambda a, b, n: True)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (
        (lambda a, b, ends, dtype: asked.append((b, ends, dtype)) or ("h", "act")) if name == "moe_grouped_mm_swiglu"
        else None))
    assert moe_math._experts_up_act(x, gate_up, groups, torch.float16) == ("h", "act")
    (b, ends, dtype), = asked
    assert torch.equal(b, gate_up.transpose(1, 2)) and ends is groups.ends and dtype == torch.float16
    h = torch.randn(10, 16)
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (
        (lambda *args: None) if name == "moe_grouped_mm_swiglu" else None))
    monkeypatch.setattr(moe_math, "_grouped_mm", lambda a, b, g: h)
    up, act = moe_math._experts_up_act(x, gate_up, groups, torch.float16)
    assert up is h and torch.equal(act, moe_math._swiglu(h, torch.float16)[3])


# ---------------------------------------------------------------------------------------------------- GPU

def _gpu_operands(H, I, sizes, dtype=torch.bfloat16, extra_rows=5, seed=0):
    """x rows [sum(sizes) + extra_rows, H], B = gate_up_proj.transpose(1, 2) (gate_up_proj [E, 2I, H]), ends."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(sum(sizes) + extra_rows, H, device="cuda", generator=g).to(dtype)
    w = (torch.randn(len(sizes), 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)  # gate_up_proj
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    return a, w.transpose(1, 2), ends


def _ragged(E: int, rows: int, seed: int) -> list:
    """E group sizes summing to about `rows`, with empty groups, a one-row group and a total not a multiple of 128."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.multinomial(torch.ones(E), rows, replacement=True, generator=g).bincount(minlength=E).tolist()
    sizes[1] = sizes[E // 2] = 0
    sizes[2] = 1
    if sum(sizes) % 128 == 0:
        sizes[3] += 1
    return sizes


def _check_bits(a, b, ends, rows, act_dtype=None, **kw):
    from kosmos.kernels import gemm_ws_host, moe_rows

    assert gemm_ws_host.swiglu_unsupported(a, b) is None
    h, act = gemm_ws_host.launch_grouped_mm_swiglu(a, b, ends, act_dtype=act_dtype, **kw)
    plain = {k: v for k, v in kw.items() if k != "programs"}
    h_ref = gemm_ws_host.launch_grouped_mm(a, b, ends, programs=kw.get("programs"), **plain)[:rows]
    act_ref = moe_rows.swiglu_rows(h_ref, act_dtype)
    assert torch.equal(h[:rows], h_ref), (h[:rows] != h_ref).nonzero()[:8].tolist()
    assert torch.equal(act[:rows], act_ref), (act[:rows] != act_ref).nonzero()[:8].tolist()


@functools.lru_cache(maxsize=2)
def _model_operands(H: int, I: int, E: int, rows: int):
    sizes = _ragged(E, rows, seed=E)
    return (*_gpu_operands(H, I, sizes), sum(sizes))


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("m_fastest,claim", SCHEDULES, ids=lambda v: str(v))
@pytest.mark.parametrize("H,I,E,rows", [(4096, 1536, 128, 20000), (7168, 2048, 32, 8000)], ids=["qwen3", "deepseek"])
def test_gpu_swiglu_gives_the_matmul_and_row_kernel_bits(H, I, E, rows, m_fastest, claim, config):
    """Qwen3-235B's expert dims (about 156 rows an expert: whole tiles and a group's last rows) and DeepSeek-V3's
    (about 250), ragged groups with empty ones and a one-row group."""
    a, b, ends, n = _model_operands(H, I, E, rows)
    _check_bits(a, b, ends, n, m_fastest=m_fastest, claim=claim, config=config)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
def test_gpu_swiglu_short_groups_and_act_dtypes(act_dtype, config):
    """Groups shorter than a tile, 63 / 64 / 65 rows in a last tile (the split's lower consumer skipping or not), a
    K not a multiple of 64, few programs, and act in another dtype: the same bits as matmul + row kernel."""
    sizes = [129, 191, 192, 193, 64, 65, 63, 1, 0, 320, 2, 128]
    a, b, ends = _gpu_operands(320, 256, sizes, seed=1)
    for programs, m_fastest, claim in ((None, False, False), (3, True, False), (5, True, True)):
        _check_bits(a, b, ends, sum(sizes), act_dtype=act_dtype, programs=programs, m_fastest=m_fastest,
                    claim=claim, config=config)


@pytest.mark.gpu
@sm90_only
def test_gpu_swiglu_fp16_over_schedules():
    """fp16 operands: the matmul + row kernel bits, and the same bits over schedules, configs and grid sizes."""
    from kosmos.kernels import gemm_ws_host

    sizes = _ragged(16, 1500, seed=3)
    a, b, ends = _gpu_operands(512, 384, sizes, dtype=torch.float16, seed=2)
    _check_bits(a, b, ends, sum(sizes), m_fastest=True, claim=True, config="128x256s")
    h1, act1 = gemm_ws_host.launch_grouped_mm_swiglu(a, b, ends, claim=True, config="128x256s")
    h2, act2 = gemm_ws_host.launch_grouped_mm_swiglu(a, b, ends, programs=7)
    rows = sum(sizes)
    assert torch.equal(h1[:rows], h2[:rows]) and torch.equal(act1[:rows], act2[:rows])
