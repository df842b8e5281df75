"""The grouped GEMM's SwiGLU up projection with its rows gathered inside the launch (grouped_ws_kernel with GATHER,
launch_grouped_mm_swiglu's rows, the op's KOSMOS_GROUPED_GATHER=1).

On the CPU: the GATHER builds for sm_90 (no spills, no ptxas advisory, within shared memory; A by cp.async with zero
fill, B by TMA, the proxy fence before the MMAs read the rows), the launcher's arguments and refusals (launch
caught), the op's opt-in and its records, and the reference experts' wiring (rows.token with the pad rows' sentinel
gives the bits of rows.gather). On an sm_90 GPU: the bits of the launch on the gathered copy.
"""
from __future__ import annotations

import re

import pytest
import torch

from _sm90 import ptxas_report
from test_grouped_swiglu import SCHEDULES, _build, _catch, _gluon_or_skip, _operands, _ragged, needs_ptxas, sm90_only


@needs_ptxas
@pytest.mark.parametrize("m_fastest,claim", SCHEDULES, ids=lambda v: str(v))
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
def test_gathered_builds_for_sm90(config, m_fastest, claim):
    """GATHER builds of every config and schedule: no spills, no advisory, within shared memory; per stage a
    thread's 16-byte cp.async copies with a zero-fill size operand (8 of them: 128 x 64 elements over 128 threads),
    B's gate / up halves as the only TMA loads, and a proxy fence after the copies land; the producer's register
    budget set."""
    gemm_ws_host = _gluon_or_skip()
    k = _build(config, m_fastest, claim, swiglu=True, gather=True)
    rep = ptxas_report(k.asm["ptx"])
    assert not rep["advisories"], "\n".join(rep["advisories"])
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["text"]
    assert k.metadata.shared <= 227 * 1024
    ptx = k.asm["ptx"]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10, %r\d+;", ptx)
    assert len(copies) == 8 and len(re.findall(r"cp\.async\.cg\.", ptx)) == 8
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::(?:cluster|cta)\.global", ptx)) == 2
    assert "fence.proxy.async.shared::cta" in ptx and "cp.async.wait_group" in ptx
    # (the producer's warps move to their budget from the launch's or from the idle workers')
    assert re.search(rf"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+{gemm_ws_host.GATHER_PRODUCER_REGS};", ptx)


def _gather_operands(S=300, T=40):
    a, b, ends = _operands()
    src = torch.zeros(T, a.shape[1], dtype=a.dtype)
    rows = torch.arange(S, dtype=torch.int64) % (T + 1)  # T: a pad row's sentinel
    return src, rows, b, ends


@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("claim", [False, True])
def test_gathered_launch_arguments(monkeypatch, config, claim):
    """launch_grouped_mm_swiglu(rows=...): GATHER on with the gathering producer's registers, the source and the
    rows as the kernel's src / idx, T, S and the row stride in 16-byte units; h and act have a row per index; the
    launch without rows passes GATHER off."""
    gemm_ws_host = _gluon_or_skip()
    from kosmos.kernels import grouped_ws, runtime

    names = grouped_ws.grouped_ws_kernel.arg_names
    seen = _catch(monkeypatch)
    src, rows, b, ends = _gather_operands()
    h, act = gemm_ws_host.launch_grouped_mm_swiglu(src, b, ends, m_fastest=True, claim=claim, config=config,
                                                   programs=5, rows=rows)
    assert h.shape == (300, 512) and act.shape == (300, 256)
    kwargs = dict(seen["kwargs"])
    assert kwargs.pop("num_warps") == gemm_ws_host.GROUPED_CONFIGS[config]["CONSUMER_WARPS"]
    assert {k: kwargs.pop(k, None) for k in runtime.COMPILE_OPTIONS} == runtime.COMPILE_OPTIONS
    assert set(kwargs) <= set(names) and kwargs["GATHER"] is True and kwargs["SWIGLU"] is True
    assert kwargs["PRODUCER_REGS"] == gemm_ws_host.GATHER_PRODUCER_REGS
    args = dict(zip(names, seen["args"]))
    assert args["src_ptr"] is src and args["idx_ptr"] is rows
    assert (args["T_src"], args["S"], args["ld8"]) == (40, 300, 128 // 8)
    assert list(args["c_desc"].shape) == [300, 512] and args["c_ptr"] is h and args["act_ptr"] is act
    gemm_ws_host.launch_grouped_mm_swiglu(*_operands(), programs=5, claim=claim, config=config)
    assert seen["kwargs"]["GATHER"] is False and seen["kwargs"]["PRODUCER_REGS"] == 40


def test_gathered_launch_refusals(monkeypatch):
    gemm_ws_host = _gluon_or_skip()
    seen = _catch(monkeypatch)
    src, rows, b, ends = _gather_operands()
    launch = gemm_ws_host.launch_grouped_mm_swiglu
    for bad in (rows.int(), rows.view(30, 10), rows[::2]):
        with pytest.raises(ValueError, match="contiguous int64"):
            launch(src, b, ends, programs=5, rows=bad)
    wide = torch.zeros(40, 256, dtype=src.dtype)
    with pytest.raises(ValueError, match="multiple of 64"):
        launch(wide[:, :120], b, ends, programs=5, rows=rows)
    assert gemm_ws_host.gather_unsupported(wide[:, :128], rows) is None  # 16-byte aligned rows of 128
    assert not seen


def test_op_gathers_only_when_asked(monkeypatch):
    """moe_ops.grouped_rows_mm_swiglu_gathered: off by default (None, nothing recorded); KOSMOS_GROUPED_GATHER=1
    launches with the rows where grouped_rows_mm_swiglu would run kosmos's kernel, else declines with the reason
    recorded. Meta tensors, launch caught: no GPU."""
    import kosmos
    from kosmos.kernels import gemm_ws_host, moe_ops

    for env in ("KOSMOS_GROUPED_MM", "KOSMOS_GROUPED_CONFIG", "KOSMOS_GROUPED_SWIGLU", moe_ops.GATHER_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(gemm_ws_host, "grouped_unsupported", lambda a, b: None)  # as on an sm_90 GPU
    launched = []
    monkeypatch.setattr(gemm_ws_host, "launch_grouped_mm_swiglu",
                        lambda a, b, ends, **kw: launched.append(kw) or ("h", "act"))

    def call(T, E, I, H, k=8):
        src = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
        rows = torch.empty(T * k + E, dtype=torch.int64, device="meta")
        b = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        ends = torch.empty(E, dtype=torch.int32, device="meta")
        return moe_ops.grouped_rows_mm_swiglu_gathered(src, rows, b, ends, torch.bfloat16)

    kosmos.reset_report()
    assert call(16384, 128, 1536, 4096) is None and not launched and not kosmos.report().runtime
    monkeypatch.setenv(moe_ops.GATHER_ENV, "1")
    assert call(16384, 128, 1536, 4096) == ("h", "act")  # Qwen3-235B: claimed tiles, split consumers
    (kw,) = launched
    assert kw["rows"].shape == (16384 * 8 + 128,) and kw["config"] == "128x256s" and kw["claim"] is True
    assert call(16384, 128, 768, 2048) is None  # Qwen3-30B-A3B: torch's grouped kernel
    assert call(4096, 256, 1600, 7168) is None  # I % 128 != 0
    monkeypatch.setenv(moe_ops.GATHER_ENV, "on")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        call(16384, 128, 1536, 4096)
    assert len(launched) == 1 and set(kosmos.report().runtime) == {
        ("grouped_mm_swiglu", "kosmos grouped_ws m-fastest claimed 128x256s swiglu gathered", "supported"),
        ("grouped_mm_gather", "moe_gather_rows, then the up projection", "the up projection runs torch._grouped_mm"),
        ("grouped_mm_gather", "moe_gather_rows, then the up projection",
         "N = 3200 is not 2I with I a multiple of 128 (a tile's column block of gate and of up)")}


def _gathered_by_torch(src, rows, b, ends, act_dtype):
    """What the gathered launch computes, by torch: the rows src[rows] (zero where rows >= T), then the up projection
    and its act as the reference has them."""
    from kosmos.ops import moe_math

    T = src.shape[0]
    x = torch.where((rows < T)[:, None], src[rows.clamp(max=T - 1)], 0)
    return moe_math._experts_up_act(x, b.transpose(1, 2), moe_math._Groups(ends, padded=True), act_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_take_the_gathered_kernel(monkeypatch, dtype):
    """moe_math.experts asks the "moe_grouped_mm_swiglu_gathered" kernel with hidden and rows.token (pads: the
    sentinel T) where it is registered, and a kernel gathering by that rule gives the layer's bits with the rows
    never gathered by moe_gather_rows; where hidden's dtype differs from the weights' it is not asked."""
    from kosmos.ops import dispatch, moe_math

    torch.manual_seed(0)
    T, H, I, E, k = 13, 16, 8, 6, 2
    hidden = torch.randn(T, H, dtype=dtype)
    ids = torch.randint(0, E, (T, k))
    ids[0, 0] = E  # a sentinel pair
    weights = torch.rand(T, k, dtype=dtype)
    gate_up, down = torch.randn(E, 2 * I, H, dtype=dtype), torch.randn(E, H, I, dtype=dtype)
    want = moe_math.experts(hidden, ids, weights, gate_up, down)
    asked = []
    row_kernel = dispatch.row_kernel

    def fake(name, device):
        if name == "moe_grouped_mm_swiglu_gathered":
            return lambda src, rows, b, ends, act_dtype: asked.append((src, rows)) or _gathered_by_torch(
                src, rows, b, ends, act_dtype)
        if name == "moe_gather_rows":
            return lambda *a: pytest.fail("the rows were gathered")
        return row_kernel(name, device)

    monkeypatch.setattr(dispatch, "row_kernel", fake)
    monkeypatch.setattr(moe_math, "_grouped_kernel", lambda a, b, n: True)
    got = moe_math.experts(hidden, ids, weights, gate_up, down)
    (src, rows), = asked
    assert src is hidden and rows.dtype == torch.int64 and int(rows.max()) == T  # the pad rows' sentinel
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    asked.clear()
    monkeypatch.setattr(dispatch, "row_kernel", lambda name, device: (lambda *a: pytest.fail("asked")) if
                        name == "moe_grouped_mm_swiglu_gathered" else row_kernel(name, device))
    moe_math.experts(hidden.double(), ids, weights, gate_up, down)  # a cast on the way: not asked


# ---------------------------------------------------------------------------------------------------- GPU

def _gpu_gather_operands(T, H, I, E, rows_total, seed, dtype=torch.bfloat16):
    """src [T, H], rows int64 [S] grouped by expert (ragged sizes, a pad row's sentinel T leading each group, as
    _SortedPairs lays them out, -1 for every third, plus trailing rows past the last group), B and ends."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    sizes = _ragged(E, rows_total, seed)
    src = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    w = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    parts = []
    for e, n in enumerate(sizes):
        parts += [torch.full((1,), -1 if e % 3 == 2 else T, device="cuda"),
                  torch.randint(0, T, (n,), device="cuda", generator=g)]
    parts.append(torch.randint(0, T, (7,), device="cuda", generator=g))
    rows = torch.cat(parts).to(torch.int64)
    ends = (torch.tensor(sizes, device="cuda") + 1).cumsum(0).to(torch.int32)
    return src, rows, w.transpose(1, 2), ends, int(ends[-1])


def _check_gathered_bits(src, rows, b, ends, n, **kw):
    """h and act of the gathered launch against the launch on moe_rows.gather_rows' copy (what the op runs without
    the gather in the launch), over the grouped rows."""
    from kosmos.kernels import gemm_ws_host, moe_rows

    h_ref, act_ref = gemm_ws_host.launch_grouped_mm_swiglu(moe_rows.gather_rows(src, rows), b, ends, **kw)
    h, act = gemm_ws_host.launch_grouped_mm_swiglu(src, b, ends, rows=rows, **kw)
    assert torch.equal(h[:n], h_ref[:n]), (h[:n] != h_ref[:n]).nonzero()[:8].tolist()
    assert torch.equal(act[:n], act_ref[:n]), (act[:n] != act_ref[:n]).nonzero()[:8].tolist()


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("m_fastest,claim", SCHEDULES, ids=lambda v: str(v))
@pytest.mark.parametrize("T,H,I,E,rows", [(2500, 4096, 1536, 128, 20000), (1000, 7168, 2048, 32, 8000)],
                         ids=["qwen3", "deepseek"])
def test_gpu_gathered_gives_the_gathered_copy_bits(T, H, I, E, rows, m_fastest, claim, config):
    """Qwen3-235B's and DeepSeek-V3's expert dims, ragged groups (empty ones, a one-row one) each led by a pad row:
    h and act bit-identical to the launch on the gathered copy."""
    _check_gathered_bits(*_gpu_gather_operands(T, H, I, E, rows, seed=E), m_fastest=m_fastest, claim=claim,
                         config=config)


@pytest.mark.gpu
@sm90_only
@pytest.mark.parametrize("config", ["128x256", "128x256s"])
def test_gpu_gathered_short_groups_grids_and_act_dtypes(config):
    """Few source rows, tiles past the last row, few programs and act in fp32: the gathered copy's bits."""
    for programs, m_fastest, claim, act_dtype in ((None, False, False, None), (3, True, False, torch.float32),
                                                  (5, True, True, None)):
        _check_gathered_bits(*_gpu_gather_operands(37, 320, 256, 12, 700, seed=4), programs=programs,
                             m_fastest=m_fastest, claim=claim, config=config, act_dtype=act_dtype)


@pytest.mark.gpu
@sm90_only
def test_gpu_reference_experts_gathered(monkeypatch):
    """The reference experts at Qwen3-235B's expert dims with KOSMOS_GROUPED_GATHER=1: the bits of the default
    (rows gathered by moe_gather_rows), and the report names the gathered launch."""
    import kosmos
    from kosmos.ops import moe_math

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, I, E, k = 2048, 4096, 1536, 128, 8
    hidden = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ids = torch.randn(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    weights = torch.rand(T, k, device="cuda", generator=g)
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).bfloat16()
    down = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
    monkeypatch.setenv("KOSMOS_GROUPED_MM", "kosmos_mc")
    want = moe_math.experts(hidden, ids, weights, gate_up, down, return_up=True)
    monkeypatch.setenv("KOSMOS_GROUPED_GATHER", "1")
    kosmos.reset_report()
    got = moe_math.experts(hidden, ids, weights, gate_up, down, return_up=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(impl.endswith("swiglu gathered") for _, impl, _ in kosmos.report().runtime), kosmos.report().runtime
