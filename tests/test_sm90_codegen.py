"""The fused kernels compiled for sm_90 on the CPU (triton's bundled ptxas): no wgmma serialization, no spills.

ptxas serializes every wgmma of a kernel (each one waited for before the next: a large slowdown that no CPU test
sees otherwise) when registers run short or the accumulator is read inside the MMA pipeline; it reports it as a
"Potential Performance Loss" advisory. These tests compile the kernels as their launchers configure them and fail
on such an advisory, and on spills where the kernel has none today. No GPU involved.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from _sm90 import compile_sm90, compile_sm90_gluon, ptxas_path, ptxas_report

pytestmark = pytest.mark.skipif(ptxas_path() is None, reason="triton without its NVIDIA backend (no ptxas)")

BF = "bf16"


def _report(kernel) -> dict:
    rep = ptxas_report(kernel.asm["ptx"])
    assert not rep["advisories"], "\n".join(rep["advisories"])
    return rep


def test_gemm_core():
    from kosmos.kernels import gemm

    cfg = gemm.select_config(8192, 4096, 4096, torch.bfloat16)
    half = cfg.block_n // 2 if cfg.epilogue_subtile else cfg.block_n
    k = compile_sm90(gemm.gemm_persistent_kernel,
                     dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                          A_TRANS=False, B_TRANS=True, HAS_BIAS=True, EPILOGUE_SUBTILE=cfg.epilogue_subtile,
                          FLATTEN=cfg.flatten, STREAM_K=True, DOT_PRECISION="tf32"),
                     dict(bias_ptr=BF, ws_ptr="fp32", cnt_ptr="i32"),
                     dict(a_desc=(torch.bfloat16, (cfg.block_m, cfg.block_k)),
                          b_desc=(torch.bfloat16, (cfg.block_n, cfg.block_k)),
                          c_desc=(torch.bfloat16, (cfg.block_m, half))),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]


@pytest.mark.parametrize("name", ["ws128", "ws64_1c", "ws128_1c", "ws256_1c", "ws128_1c_sk", "ws128_1c_ht",
                                  "ws256_2s"])
@pytest.mark.parametrize("b_trans", [True, False], ids=["w.t()", "kn"])
def test_gemm_warp_specialized(name, b_trans):
    from kosmos.kernels import gemm, gemm_ws, gemm_ws_host

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    cfg = gemm.CONFIGS[name]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    rows = bm // 2 if cfg.ws_split else bm
    k = compile_sm90_gluon(gemm_ws.gemm_ws_kernel,
                           dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, STAGES=cfg.num_stages,
                                B_TRANS=b_trans, HAS_BIAS=True, STREAM_K=cfg.stream_k, HALF_TAIL=cfg.half_tail,
                                CONSUMER_REGS=232, PRODUCER_REGS=40, NUM_CONSUMERS=cfg.ws_consumers,
                                PRODUCER_WARPS=1, CONSUMER_WARPS=cfg.num_warps, ROW_SPLIT=cfg.ws_split),
                           dict(bias_ptr=BF, ws_ptr="fp32", cnt_ptr="i32"),
                           dict(a_desc=(torch.bfloat16, (rows, bk)), a_half_desc=(torch.bfloat16, (bm // 2, bk)),
                                b_desc=(torch.bfloat16, (bn, bk) if b_trans else (bk, bn)),
                                c_desc=(torch.bfloat16, (rows, bn)), c_half_desc=(torch.bfloat16, (bm // 2, bn))),
                           num_warps=cfg.num_warps)
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]
    ptx = k.asm["ptx"]
    # the partitions really are split (register budgets moved between warpgroups), and fit the shared memory
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("m_fastest,claim,config", [(False, False, "128x256"), (True, False, "128x256"),
                                                     (True, True, "128x256"), (True, False, "128x256s"),
                                                     (True, True, "128x256s")],
                         ids=["n_fastest", "m_fastest", "m_fastest_claimed", "m_fastest_split",
                              "m_fastest_claimed_split"])
@pytest.mark.parametrize("b_trans", [True, False], ids=["nk", "kn"])
def test_grouped_warp_specialized(b_trans, m_fastest, claim, config):
    from kosmos.kernels import gemm_ws_host, grouped_ws

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    bm, bn, bk = gemm_ws_host.GROUPED_BLOCK
    cfg = gemm_ws_host.GROUPED_CONFIGS[config]
    rows = bm // cfg["NUM_CONSUMERS"]
    k = compile_sm90_gluon(grouped_ws.grouped_ws_kernel,
                           dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, B_TRANS=b_trans, M_FASTEST=m_fastest,
                                CLAIM=claim, **cfg),
                           dict(c_ptr=BF, ends_ptr="i32", claim_ptr="i32", src_ptr=BF, idx_ptr="i64"),
                           dict(a_desc=(torch.bfloat16, (rows, bk)),
                                b_desc=(torch.bfloat16, (bn, bk) if b_trans else (bk, bn)),
                                c_desc=(torch.bfloat16, (rows, bn))),
                           num_warps=cfg["CONSUMER_WARPS"])
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]
    assert "setmaxnreg.dec" in k.asm["ptx"]  # the one-warp producer gives its registers back
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("tail_by_tma", [True, False], ids=["tail_tma", "tail_zeroed"])
@pytest.mark.parametrize("config", ["128x256", "128x128", "128x128pp", "64x256pp"])
def test_grouped_wgrad_warp_specialized(config, tail_by_tma):
    from kosmos.kernels import gemm_ws_host, grouped_wgrad_ws

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    bm, bn, bk, stages, warps, consumers = gemm_ws_host.WGRAD_CONFIGS[config]
    k = compile_sm90_gluon(grouped_wgrad_ws.grouped_wgrad_kernel,
                           dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, PRODUCER_REGS=40,
                                CONSUMER_WARPS=warps, NUM_CONSUMERS=consumers, CONSUMER_REGS=232,
                                TAIL_BY_TMA=tail_by_tma),
                           dict(ends_ptr="i32", a_ptr=BF, b_ptr=BF),
                           dict(a_desc=(torch.bfloat16, (bk, bm)), b_desc=(torch.bfloat16, (bk, bn)),
                                c_desc=(torch.bfloat16, (bm, bn))),
                           num_warps=warps)
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]
    ptx = k.asm["ptx"]
    assert "setmaxnreg.dec" in ptx and "wgmma.mma_async" in ptx
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("weights,remap", [(1, False), (3, False), (1, True)], ids=["one_weight", "qkv", "remap"])
def test_ag_gemm(weights, remap):
    from kosmos.kernels import ag_gemm

    cfg = ag_gemm.ag_config(1, 8192, [4096] * weights, 4096, torch.bfloat16)
    k = compile_sm90(ag_gemm.ag_gemm_kernel,
                     dict(NW=weights, B_TRANS=True, C_ONCE=weights == 1, EPILOGUE_TMA=True, BLOCK_M=cfg.block_m,
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EPILOGUE_SUBTILE=cfg.epilogue_subtile,
                          DOT_PRECISION="tf32", COPY_ROWS=ag_gemm.COPY_ROWS, COPY_COLS=ag_gemm.COPY_COLS,
                          USE_ASM=True, REMAP=remap),
                     dict(stream_ptr="i32", ws_table="i64", a_ptr=BF, g_ptr=BF, **{f"w{i}": BF for i in range(4)},
                          **{f"b{i}": BF for i in range(4)}, **{f"o{i}": BF for i in range(4)}),
                     int64=("err_host", "timeout_ns", "straggle_ns"),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]


@pytest.mark.parametrize("pairs", [1, 2])
def test_gemm_rs(pairs):
    from kosmos.kernels import gemm_rs

    cfg = gemm_rs.rs_config(8192, 4096, [4096] * pairs, torch.bfloat16, 2)
    k = compile_sm90(gemm_rs.gemm_rs_kernel,
                     dict(NP=pairs, B_TRANS=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          DOT_PRECISION="tf32", RED_N=min(128, cfg.block_n), USE_ASM=True),
                     dict(stream_ptr="i32", ws_table="i64", **{f"x{i}": BF for i in range(4)},
                          **{f"w{i}": BF for i in range(4)}, bias_ptr=BF, out_ptr=BF),
                     int64=("err_host", "timeout_ns", "straggle_ns"), floats=("scale",),
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]


def _sass_ops(kernel) -> list:
    """The opcodes of a compiled kernel's sm_90 code, in order (cuobjdump next to triton's ptxas)."""
    import os
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas_path()), "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]+)", sass)


def _qwen3_routing() -> dict:
    """moe_forward_kernel's routing constexprs for a Qwen3 layer: softmax top-8 of 128 experts, renormalised, bf16."""
    from kosmos.kernels import moe

    return moe.routing_constexprs("softmax", True, 1, 1, 1.0, torch.bfloat16, None, None, 8, 128, torch.bfloat16,
                                  torch.bfloat16)


def _deepseek_v3_routing() -> dict:
    """The same for DeepSeek-V3: fp32 sigmoid router with correction bias, top-8 of 256 in 8 groups (top 4), x2.5."""
    from kosmos.kernels import moe

    return moe.routing_constexprs("sigmoid", True, 8, 4, 2.5, torch.float32, None, torch.zeros(1), 8, 256,
                                  torch.bfloat16, torch.bfloat16, torch.bfloat16)


# the int arguments of moe_forward_kernel that are multiples of 16 in the models' layers (Triton's JIT specializes
# them so at the call: Qwen3 / DeepSeek-V3 dims and row strides)
MOE_DIV16 = ("H", "I", "E", "h_ld", "o_ld", "rw_ld")


def _compile_moe_forward(cfg, consts: dict, router: str, router_weight: str = None, w_f32: bool = False):
    """moe_forward_kernel for sm_90 with saved_up, as its launcher builds it: bf16 expert weights and hidden states,
    the biases and logits of dtype `router`, the router weight of `router_weight` (default `router`); RGEMM tasks
    through TMA for the "bf16x3" router; fp32 routing weights with w_f32."""
    rgemm_tma = cfg.router_gemm == 1 and consts["ROUTER_PRECISION"] == "bf16x3"
    from kosmos.kernels import moe

    return compile_sm90(moe.moe_forward_kernel,
                        dict(**consts, RET_LOGITS=False, BT=cfg.bt, BKR=cfg.bkr, BM=cfg.bm, BI=cfg.bi, BK=cfg.bk,
                             BN=cfg.bn, BK2=cfg.bk2, BH=cfg.bh, SCAN_T=cfg.scan_t, SAVE_UP=True, USE_ASM=True,
                             FOLD_GROUPS=cfg.fold_groups, ROUTER_GEMM=cfg.router_gemm == 1, RGEMM_TMA=rgemm_tma,
                             RBM=cfg.rbm, RBN=cfg.rbn, BKG=cfg.bkg, JOINT_GU=cfg.joint_gate_up,
                             GATHER_UP=cfg.gather_up, TRACE=False, W_F32=w_f32,
                             GROUP_BLOCKS=cfg.group_blocks),
                        dict(ctrl="i32", hidden=BF, rw=router_weight or router, rb=router, cb=router, logits=router,
                             ids_ptr="i32", w_ptr="fp32", rank_ptr="i32", counts="i32", meta="i32", tpe="i32",
                             x_sorted=BF, perm="i32", act=BF, saved_up=BF, y=BF, out=BF, trace="i64"),
                        dict(x_desc=(torch.bfloat16, (cfg.bm, cfg.bk)),
                             gu_desc=(torch.bfloat16, (1, 2, cfg.bi, cfg.bk) if cfg.joint_gate_up else (cfg.bi, cfg.bk)),
                             down_desc=(torch.bfloat16, (cfg.bn, cfg.bk2)),
                             act_desc=(torch.bfloat16, (cfg.bm, cfg.bk2)),
                             xr_desc=(torch.bfloat16, (cfg.rbm, cfg.bkg) if rgemm_tma else (cfg.bm, cfg.bk)),
                             wr_desc=(torch.bfloat16, (cfg.rbn, cfg.bkg) if rgemm_tma else (cfg.bm, cfg.bk))),
                        int64=("err_host", "timeout_ns"), floats=("rsf", "eps"),
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, div16=MOE_DIV16)


@pytest.mark.parametrize("fold_groups", [1, 4])
def test_moe_forward(fold_groups):
    """The MoE forward kernel as the Qwen3 layers run it (wide tiles, bf16, saved up projection; DOWN / FOLD in one
    or four column groups): no wgmma serialization. It does spill (255 registers: the router's [BT, E] tiles),
    outside the UP / DOWN K loops."""
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], fold_groups=fold_groups, **moe.wide_forward(128))
    consts = _qwen3_routing()
    _report(_compile_moe_forward(cfg, consts, BF))


def test_moe_forward_fp32_routing_weights():
    """The Qwen3 build with Mixtral's fp32 routing weights (W_F32: not rounded to bf16; the fold's products in fp32,
    PD_F32), with the UP / DOWN tasks block by block and 16 blocks at a time: no wgmma serialization."""
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], **moe.wide_forward(128))
    consts = moe.routing_constexprs("softmax", True, 1, 1, 1.0, torch.bfloat16, None, None, 2, 8, torch.bfloat16,
                                    torch.bfloat16, weights_dtype=torch.float32)
    assert consts["PD_F32"]
    _report(_compile_moe_forward(cfg, consts, BF, w_f32=True))
    # Mixtral's dims take the grouped task order (forward_configs): the same build with group_blocks
    _report(_compile_moe_forward(dataclasses.replace(cfg, group_blocks=16), consts, BF, w_f32=True))


def test_moe_forward_deepseek_router():
    """The MoE forward with DeepSeek-V3's router (256 experts in 32-token ROUTE tiles; fp32 router on 16-bit
    hidden states: the weight split into two TF32 dots per K block, as on fp16 hidden states and under EP): no wgmma
    serialization."""
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], **moe.wide_forward(256))
    consts = _deepseek_v3_routing()
    assert consts["ROUTER_PRECISION"] == "tf32x3"
    _report(_compile_moe_forward(cfg, consts, "fp32"))


def test_moe_forward_deepseek_router_gemm():
    """The same as its launcher runs it on bf16 hidden states (MoeConfig.router_gemm): RGEMM tasks of 128 tokens x
    128 experts over the weight pre-split into three bf16 parts (TMA), ROUTE tiles selecting from the stored
    logits: no wgmma serialization. (ptxas, triton 3.6.0, with H / I / E / strides marked multiples of 16 as at the
    call: 512 bytes of spill stores, 336 in the Qwen3 build above.)"""
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], fold_groups=2, router_gemm=1, **moe.wide_forward(256))
    consts = _deepseek_v3_routing()
    consts["ROUTER_PRECISION"] = "bf16x3"
    _report(_compile_moe_forward(cfg, consts, "fp32", router_weight=BF))


@pytest.mark.parametrize("config", ["wide", "narrow"])
def test_reference_router_gemm(config):
    """The reference forward's fp32 router on bf16 hidden states (kosmos.kernels.router_gemm) in each tile config of
    its launcher: the RGEMM tile on wgmma, no serialization advisory, no spills."""
    from kosmos.kernels import router_gemm

    rbm, rbn, bkg, warps, stages = router_gemm.CONFIGS[config]
    k = compile_sm90(router_gemm._router_logits_kernel, dict(HAS_RB=False, RBM=rbm, RBN=rbn, BKG=bkg),
                     dict(rb="fp32", logits="fp32"),
                     dict(xr_desc=(torch.bfloat16, (rbm, bkg)), wr_desc=(torch.bfloat16, (rbn, bkg))),
                     num_warps=warps, num_stages=stages, div16=("H", "E"))
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]
    assert "wgmma" in k.asm["ptx"]


@pytest.mark.parametrize("layer", ["qwen3", "deepseek_v3"])
def test_reference_route_select(layer):
    """The reference forward's routing selection (kosmos.kernels.route_select) as its launcher builds it for a
    Qwen3 router (bf16 logits, 128 experts) and DeepSeek-V3's (fp32, 256 experts in 8 groups, correction bias):
    no spills."""
    from kosmos.kernels import route_select

    routing = _qwen3_routing() if layer == "qwen3" else _deepseek_v3_routing()
    rd = BF if layer == "qwen3" else "fp32"
    k = compile_sm90(route_select._select_kernel, route_select.kernel_constexprs(routing),
                     dict(logits=rd, cb="fp32", ids="i64", w=rd, ranks="i32", counts="i32"), floats=("rsf", "eps"),
                     num_warps=route_select.NUM_WARPS, div16=("E",))
    rep = _report(k)
    assert rep["spill_stores"] == 0, rep["text"]


def test_moe_forward_joint_gate_up():
    """MoeConfig.joint_gate_up: the UP tile's gate and up blocks as one operand, one wgmma of width 2*BI (64x256 on
    the Qwen3 build) where joint_gate_up=False runs two of width BI; no wgmma serialization (the wide config has it on).
    The expert tiles' epilogues store 16-byte vectors (one 2-byte STG per element when the int arguments are not
    marked multiples of 16, as they are at the call). (ptxas, triton 3.6.0: the UP K loop holds 4 HGMMA.64x256x16
    and no shared-memory loads / stores or spills, where the split form has 8 HGMMA.64x128x16; with 32-token tiles and
    four stages 140 bytes of spill stores against 164, the same 196640 B of shared memory.)"""
    import collections
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], **moe.wide_forward(128))
    consts = _qwen3_routing()
    k = _compile_moe_forward(cfg, consts, BF)
    _report(k)
    ops = _sass_ops(k)
    # 4 in the DOWN K loop and 4 in the UP K loop (the default build: 4, and 8 of width 128 in its UP loop)
    assert ops.count("HGMMA.64x256x16.F32.BF16") == 8, sorted({op for op in ops if op.startswith("HGMMA")})
    stores = collections.Counter(op for op in ops if op.startswith("STG"))
    assert stores["STG.E.128"] > 4 * stores["STG.E.U16"], stores


def test_moe_forward_gather_up():
    """MoeConfig.gather_up: the UP K loop loads its x block from hidden through the sorted row -> token map with
    cp.async (LDGSTS, 16-byte vectors) beside the weight's TMA loads; no wgmma serialization, the same shared memory
    as the TMA build. (ptxas, triton 3.6.0, 32-token tiles and four stages: 132 bytes of spill stores against 140,
    196640 B of shared memory.)"""
    import dataclasses

    from kosmos.kernels import moe

    cfg = dataclasses.replace(moe.CONFIGS["default"], gather_up=True, **moe.wide_forward(128))
    consts = _qwen3_routing()
    k = _compile_moe_forward(cfg, consts, BF)
    _report(k)
    assert k.metadata.shared <= 227 * 1024
    ops = _sass_ops(k)
    assert "LDGSTS.E.BYPASS.128" in ops
    assert ops.count("HGMMA.64x256x16.F32.BF16") == 8


def _catch_launch(monkeypatch, module, kernel_name: str) -> dict:
    """Replaces module.kernel_name by a stand-in whose `[grid](*args, **kwargs)` records its call (no GPU)."""
    seen = {}

    class Catch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(grid=grid, args=args, kwargs=kwargs)

    monkeypatch.setattr(module, kernel_name, Catch())
    return seen


def _kernel_keywords(kernel, seen: dict) -> dict:
    """The recorded call's keyword arguments (num_warps and runtime.COMPILE_OPTIONS, which it must pass, taken out),
    checked against the kernel's parameters: each one of them, and every parameter without a default given,
    positionally or by keyword."""
    from kosmos.kernels import runtime

    kwargs = dict(seen["kwargs"])
    kwargs.pop("num_warps")
    assert {k: kwargs.pop(k, None) for k in runtime.COMPILE_OPTIONS} == runtime.COMPILE_OPTIONS
    names = kernel.arg_names
    assert set(kwargs) <= set(names), set(kwargs) - set(names)
    defaults = {p.name for p in kernel.params if p.default is not inspect.Parameter.empty}
    missing = set(names) - set(kwargs) - set(names[:len(seen["args"])])
    assert missing <= defaults, missing - defaults
    return kwargs


@pytest.mark.parametrize("config", ["128x256", "128x256s"])
@pytest.mark.parametrize("claim", [False, True])
def test_grouped_launcher_arguments_are_the_kernels(monkeypatch, config, claim):
    """launch_grouped_mm's keyword arguments are parameters of grouped_ws_kernel (no GPU: the launch is caught),
    its descriptors' blocks are the config's, and every constexpr without a default is given."""
    from kosmos.kernels import gemm_ws_host, grouped_ws

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    real = grouped_ws.grouped_ws_kernel
    seen = _catch_launch(monkeypatch, grouped_ws, "grouped_ws_kernel")
    a = torch.zeros(300, 128, dtype=torch.bfloat16)
    b = torch.zeros(3, 256, 128, dtype=torch.bfloat16).transpose(1, 2)
    ends = torch.tensor([100, 100, 300], dtype=torch.int32)
    gemm_ws_host.launch_grouped_mm(a, b, ends, programs=5, m_fastest=True, claim=claim, config=config)
    assert seen["kwargs"]["num_warps"] == gemm_ws_host.GROUPED_CONFIGS[config]["CONSUMER_WARPS"]
    kwargs = _kernel_keywords(real, seen)
    rows = gemm_ws_host.GROUPED_BLOCK[0] // kwargs["NUM_CONSUMERS"]
    a_desc, _, c_desc = seen["args"][:3]
    assert list(a_desc.block_shape) == [rows, 64] and list(c_desc.block_shape) == [rows, 256]
    assert kwargs["CLAIM"] == claim and seen["grid"] == (5,)


@pytest.mark.parametrize("name", ["ws256_1c", "ws256_2s", "ws128", "ws128_1c_ht"])
def test_gemm_ws_launcher_arguments_are_the_kernels(monkeypatch, name):
    """gemm_ws_host.launch's keyword arguments are parameters of gemm_ws_kernel (no GPU: the launch is caught) and
    its A / C descriptors hold a consumer's rows of a tile."""
    from kosmos.kernels import gemm, gemm_ws, gemm_ws_host

    if gemm_ws_host.gluon_missing():
        pytest.skip(gemm_ws_host.gluon_missing())
    real = gemm_ws.gemm_ws_kernel
    seen = _catch_launch(monkeypatch, gemm_ws, "gemm_ws_kernel")
    cfg = gemm.CONFIGS[name]
    a = torch.zeros(1000, 512, dtype=torch.bfloat16)
    w = torch.zeros(768, 512, dtype=torch.bfloat16)
    c = torch.empty(1000, 768, dtype=torch.bfloat16)
    lay = gemm.GemmLayout(1000, 768, 512, a_lead=512, b_trans=True, b_lead=512)  # check_operands wants CUDA
    plan = gemm.plan_gemm(lay.M, lay.N, lay.K, cfg, 132)
    gemm_ws_host.launch(a, w.t(), None, c, cfg, lay, plan, c, c, 4)
    assert seen["kwargs"]["num_warps"] == cfg.num_warps
    kwargs = _kernel_keywords(real, seen)
    rows = cfg.block_m // 2 if cfg.ws_split else cfg.block_m
    a_desc, c_desc = seen["args"][0], seen["args"][3]
    assert list(a_desc.block_shape) == [rows, cfg.block_k] and list(c_desc.block_shape) == [rows, cfg.block_n]
    assert kwargs["ROW_SPLIT"] == cfg.ws_split
