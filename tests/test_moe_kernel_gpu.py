"""The fused MoE forward kernel (kosmos.kernels.moe) on one CUDA GPU (sm_90+) against the reference `route` +
`experts` of kosmos.ops.moe: bf16 / fp16 / fp32, ragged T, empty experts, skewed routing, top-1, bit-identical
reruns over grid sizes, a CUDA graph replayed on changing inputs, and torch.compile(backend="kosmos") of a tiny HF
Qwen3-MoE with KOSMOS_FUSED_MOE=1 reporting the fused impl.

The expert outputs are compared with the reference run on the KERNEL's routing (returned with return_routing=True):
a near-tie between two experts' scores may resolve differently under another accumulation order, which is not an
error of the experts; the routing itself is compared separately (ids equal on all but a few near-tied rows).
Outputs are poisoned with NaN before a run where the API allows it (the saved_up tests: every float tensor the
launcher allocates starts as NaN).
Passed on an H200 (2026-11-29; benchmarks/RESULTS.md), before the up tiles read x_sorted through TMA and before
save_up: the saved_up tests (and the rest of the file on the TMA up tiles) have not run on a GPU yet.
"""
from __future__ import annotations

import pytest
import torch

from _moe_gpu import MARKS, exact_fp32, rel_err, spin_bound  # noqa: F401  (autouse fixtures)

pytestmark = MARKS

from kosmos.kernels import runtime  # noqa: E402
from kosmos.ops.moe_math import experts, route  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def make(T, H, I, E, dtype, seed=0, router_scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    rw = (torch.randn(E, H, device="cuda", generator=g) * router_scale / H ** 0.5).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    d = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dtype)
    return h, rw, gu, d


def run_and_check(h, rw, gu, d, top_k, *, router_bias=None, norm=True, rsf=1.0, router_dtype=None, programs=None,
                  max_flipped_rows=2, scoring="softmax", correction=None, n_group=1, topk_group=1,
                  weights_dtype=None):
    from kosmos.kernels.moe import moe_forward

    out, logits, tpe, ids, w = moe_forward(h, rw, router_bias, correction, gu, d, top_k, scoring, norm, n_group,
                                           topk_group, routed_scaling_factor=rsf, router_dtype=router_dtype,
                                           return_router_logits=True, programs=programs, return_routing=True,
                                           weights_dtype=weights_dtype)
    torch.cuda.synchronize()
    ref_logits, ref_ids, ref_w = route(h, rw, router_bias, correction, top_k, scoring, norm, n_group, topk_group, rsf,
                                       router_dtype, weights_dtype=weights_dtype)
    assert logits.dtype == ref_logits.dtype
    assert rel_err(logits, ref_logits) <= TOL[logits.dtype], "router logits"
    flipped = (ids.long().sort(dim=1).values != ref_ids.sort(dim=1).values).any(dim=1).sum().item()  # sets of ids
    assert flipped <= max_flipped_rows, f"{flipped} tokens routed differently from the reference"
    # the experts on the kernel's own routing
    ref, counts = experts(h, ids.long(), w.to(ref_w.dtype), gu, d)
    assert torch.equal(tpe, counts), (tpe, counts)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= TOL[h.dtype], err
    return out, logits, tpe, ids, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H,I,E,k", [(300, 256, 128, 8, 2), (1000, 512, 192, 16, 4), (257, 128, 64, 64, 8)])
def test_matches_reference(dtype, T, H, I, E, k):
    h, rw, gu, d = make(T, H, I, E, dtype, seed=T)
    run_and_check(h, rw, gu, d, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top1_bias_scaling_no_renorm_router_fp32(dtype):
    h, rw, gu, d = make(333, 256, 128, 8, dtype, seed=3)
    bias = torch.linspace(-0.2, 0.2, 8, device="cuda").to(dtype)
    run_and_check(h, rw, gu, d, 1, router_bias=bias, norm=False, rsf=2.5, router_dtype=torch.float32)


@pytest.mark.parametrize("T,k", [(300, 2), (1000, 8)])
def test_mixtral_fp32_weights_on_bf16(T, k):
    """Mixtral's router on bf16: softmax in fp32, top-k renormalised, the weights kept in fp32 (weights_dtype) and
    the fold's products in fp32. The kernel's weights are the reference's on rows routed alike (not their bf16
    roundings), and the output is the reference experts' with those fp32 weights."""
    h, rw, gu, d = make(T, 256, 128, 8, torch.bfloat16, seed=T + k)
    out, logits, tpe, ids, w = run_and_check(h, rw, gu, d, k, weights_dtype=torch.float32)
    ref_logits, ref_ids, ref_w = route(h, rw, None, None, k, "softmax", True, 1, 1, 1.0, None,
                                       weights_dtype=torch.float32)
    assert ref_w.dtype == torch.float32
    # rows with the same logits and the same experts (near-ties may order them differently): weights per expert
    same = (logits == ref_logits).all(dim=1) & (ids.long().sort(1).values == ref_ids.sort(1).values).all(dim=1)
    assert same.sum() >= 0.9 * T, same.sum()
    zeros = torch.zeros(T, 8, device="cuda")
    per_expert, ref_per_expert = zeros.scatter(1, ids.long(), w)[same], zeros.scatter(1, ref_ids, ref_w)[same]
    assert torch.allclose(per_expert, ref_per_expert, rtol=1e-6, atol=0), (per_expert - ref_per_expert).abs().max()
    assert not torch.equal(w, w.bfloat16().float()), "the weights were rounded to bf16"
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_v3_router(dtype):
    """sigmoid, correction bias, 8 groups (top-4 groups), top-8 of 64, renorm + 1e-20, scaling 2.5, fp32 router."""
    h, rw, gu, d = make(600, 256, 128, 64, dtype, seed=9)
    corr = torch.linspace(-0.05, 0.05, 64, device="cuda")
    run_and_check(h, rw, gu, d, 8, scoring="sigmoid", correction=corr, n_group=8, topk_group=4, rsf=2.5,
                  router_dtype=torch.float32)


@pytest.mark.parametrize("router_gemm", [1, 0], ids=["rgemm_bf16x3", "route_tiles_tf32x3"])
def test_fp32_router_on_bf16_hidden_is_fp32_accurate(router_gemm):
    """DeepSeek-V3's fp32 router on bf16 hidden states (router_precision "tf32x3"; by default RGEMM tasks of three
    bf16 dots of the pre-split weight, MoeConfig.router_gemm; else two TF32 dots in the ROUTE tiles): its logits are
    as close to the fp64 product as cuBLAS's exact fp32 GEMM's (torch.backends.cuda.matmul.allow_tf32 off)."""
    import dataclasses

    from kosmos.kernels.moe import forward_configs, moe_forward
    from kosmos.kernels.moe_ops import router_precision

    assert not torch.backends.cuda.matmul.allow_tf32
    assert router_precision(torch.float32, torch.bfloat16) == "tf32x3"
    h, _, gu, d = make(256, 7168, 64, 256, torch.bfloat16, seed=12)
    rw = torch.randn(256, 7168, device="cuda", generator=torch.Generator(device="cuda").manual_seed(13)) / 7168 ** 0.5
    cfg = dataclasses.replace(forward_configs(h, gu)[-1], router_gemm=router_gemm)
    _, logits, _ = moe_forward(h, rw, None, None, gu, d, 8, "sigmoid", True, 8, 4, routed_scaling_factor=2.5,
                               router_dtype=torch.float32, return_router_logits=True, config=cfg)
    exact = h.double() @ rw.double().T
    cublas = h.float() @ rw.T
    err_kernel, err_cublas = rel_err(logits, exact), rel_err(cublas, exact)
    assert err_kernel <= max(4 * err_cublas, 1e-7), (err_kernel, err_cublas)


def test_deepseek_v3_router_256_experts():
    """DeepSeek-V3's router at its 256 experts (RGEMM tasks of 128 tokens x 128 experts on the weight split into
    three bf16 parts, then 32-token ROUTE tiles selecting), ragged T: against the reference, bit-identical on another
    grid size, and the same outputs when the logits are not returned."""
    from kosmos.kernels.moe import moe_forward

    h, rw, gu, d = make(1000, 512, 64, 256, torch.bfloat16, seed=14)
    rw = rw.float()
    corr = torch.linspace(-0.05, 0.05, 256, device="cuda")
    router = dict(scoring="sigmoid", correction=corr, n_group=8, topk_group=4, rsf=2.5, router_dtype=torch.float32)
    first = run_and_check(h, rw, gu, d, 8, **router)
    again = run_and_check(h, rw, gu, d, 8, **router, programs=7)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "grid sizes not bit-identical"
    out, logits, tpe, ids, w = moe_forward(h, rw, None, corr, gu, d, 8, "sigmoid", True, 8, 4,
                                           routed_scaling_factor=2.5, router_dtype=torch.float32, return_routing=True)
    assert logits.shape[0] == 0
    assert all(torch.equal(a, b) for a, b in zip((out, tpe, ids, w), (first[0],) + first[2:]))


def test_router_gemm_without_tma_same_bits():
    """DeepSeek-V3's router as RGEMM tasks on hidden states whose row stride TMA cannot take (16-byte multiples):
    the pointer-load RGEMM, the same bits as through TMA; and both close to the ROUTE tiles' TF32 split."""
    import dataclasses

    from kosmos.kernels.moe import forward_configs, moe_forward

    h, rw, gu, d = make(1000, 512, 64, 256, torch.bfloat16, seed=15)
    rw = rw.float()
    wide = torch.zeros(1000, 516, dtype=h.dtype, device=h.device)
    wide[:, :512] = h
    h_odd = wide[:, :512]  # row stride 516 elements = 1032 bytes
    corr = torch.linspace(-0.05, 0.05, 256, device="cuda")
    args = (rw, None, corr, gu, d, 8, "sigmoid", True, 8, 4)
    kw = dict(routed_scaling_factor=2.5, router_dtype=torch.float32, return_router_logits=True, return_routing=True)
    tma = moe_forward(h, *args, **kw)
    pointers = moe_forward(h_odd, *args, **kw)
    assert all(torch.equal(a, b) for a, b in zip(tma, pointers))
    tiles = moe_forward(h, *args, **kw, config=dataclasses.replace(forward_configs(h, gu)[0], router_gemm=0))
    assert rel_err(tiles[1], tma[1]) < 1e-6


def test_sigmoid_bf16_router_no_renorm():
    h, rw, gu, d = make(300, 256, 128, 16, torch.bfloat16, seed=10)
    run_and_check(h, rw, gu, d, 2, scoring="sigmoid", norm=False, router_bias=torch.linspace(
        -0.1, 0.1, 16, device="cuda").to(torch.bfloat16))


def test_empty_experts_and_skew():
    h, rw, gu, d = make(513, 256, 128, 16, torch.bfloat16, seed=4)
    bias = torch.zeros(16, device="cuda", dtype=torch.bfloat16)
    bias[[1, 5, 9, 10]] = -60.0  # never chosen
    bias[3] = 30.0  # every token's first choice
    _, _, tpe, _, _ = run_and_check(h, rw, gu, d, 2, router_bias=bias)
    assert tpe[[1, 5, 9, 10]].tolist() == [0, 0, 0, 0]
    assert tpe[3].item() == 513


def test_all_tokens_on_one_expert_top1():
    h, rw, gu, d = make(1000, 256, 128, 8, torch.bfloat16, seed=5)
    bias = torch.zeros(8, device="cuda", dtype=torch.bfloat16)
    bias[6] = 60.0
    _, _, tpe, _, _ = run_and_check(h, rw, gu, d, 1, router_bias=bias)
    assert tpe.tolist() == [0, 0, 0, 0, 0, 0, 1000, 0]


@pytest.mark.parametrize("T", [1, 7, 65, 129])
def test_small_and_ragged_T(T):
    h, rw, gu, d = make(T, 128, 64, 8, torch.bfloat16, seed=T)
    run_and_check(h, rw, gu, d, 2)


def test_bit_identical_over_grid_sizes():
    from kosmos.kernels.moe import moe_forward

    h, rw, gu, d = make(2000, 512, 256, 32, torch.bfloat16, seed=6)
    first = moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True)
    for programs in (1, 3, 17, None, runtime.num_sms(h.device)):
        for _ in range(2):
            again = moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True,
                                programs=programs)
            for a, b in zip(first, again):
                assert torch.equal(a, b), programs


def test_fold_groups_bit_identical_over_grid_sizes():
    """DOWN / FOLD in column groups (MoeConfig.fold_groups): the folds of a group run beside the next group's DOWN
    tiles on other SMs; the bits are those of one group for every grid size (H = 1280: five 256-column chunks, so
    2 / 4 / 8 groups leave a short last group or clamp to 5)."""
    import dataclasses

    from kosmos.kernels import moe

    h, rw, gu, d = make(3000, 1280, 256, 32, torch.bfloat16, seed=8)
    base = dataclasses.replace(moe.forward_configs(h, gu)[0], fold_groups=1)
    first = moe.moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True,
                            save_up=True, config=base)
    run_and_check(h, rw, gu, d, 4)
    for groups in (2, 4, 8):
        cfg = dataclasses.replace(base, fold_groups=groups)
        for programs in (None, 5, 17):
            again = moe.moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True,
                                    save_up=True, config=cfg, programs=programs)
            for a, b in zip(first, again):
                assert torch.equal(a, b), (groups, programs)
    torch.cuda.synchronize()
    assert int(moe.control(h.device).ctrl.abs().sum()) == 0  # the group counters zeroed too


def test_cuda_graph_replay_with_changing_inputs():
    from kosmos.kernels.moe import moe_forward

    T, H, I, E, k = 700, 256, 128, 16, 2
    h, rw, gu, d = make(T, H, I, E, torch.bfloat16, seed=7)
    static_h = h.clone()
    moe_forward(static_h, rw, None, None, gu, d, k)  # warm up: compile, grow the control tensor
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _, g_tpe = moe_forward(static_h, rw, None, None, gu, d, k)
    for step in range(20):
        new = make(T, H, I, E, torch.bfloat16, seed=100 + step)[0]
        if step % 5 == 4:  # skew the routing between replays
            new = new + rw[step % E].float().to(new.dtype) * 8
        static_h.copy_(new)
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out, _, tpe = moe_forward(new, rw, None, None, gu, d, k)
        assert torch.equal(g_tpe, tpe), step
        assert torch.equal(g_out, out), step
        logits, ids, w = route(new, rw, None, None, k, "softmax", True, 1, 1, 1.0, None)
        ref, _ = experts(new, ids, w, gu, d)
        assert rel_err(g_out, ref) <= 3e-2, step  # reference routing: a near-tie may flip a row


def test_router_gemm_cuda_graph_replay_with_changing_weight():
    """DeepSeek-V3's router as RGEMM tasks inside a captured graph: the weight's bf16 split is captured with the
    launch, so replays follow in-place updates of the fp32 router weight (an optimizer step) and new hidden states."""
    from kosmos.kernels.moe import moe_forward

    T, H, I, E, k = 700, 256, 128, 64, 8
    h, rw, gu, d = make(T, H, I, E, torch.bfloat16, seed=17)
    rw = rw.float()
    corr = torch.linspace(-0.05, 0.05, E, device="cuda")
    args = (corr, gu, d, k, "sigmoid", True, 8, 4)
    kw = dict(routed_scaling_factor=2.5, router_dtype=torch.float32, return_router_logits=True)
    static_h = h.clone()
    moe_forward(static_h, rw, None, *args, **kw)  # warm up: compile, grow the control tensor
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_logits, g_tpe = moe_forward(static_h, rw, None, *args, **kw)
    for step in range(6):
        static_h.copy_(make(T, H, I, E, torch.bfloat16, seed=200 + step)[0])
        rw.add_(torch.randn_like(rw) * 0.02)  # in place, as an optimizer step
        g_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out, logits, tpe = moe_forward(static_h, rw, None, *args, **kw)
        assert torch.equal(g_logits, logits) and torch.equal(g_tpe, tpe) and torch.equal(g_out, out), step


# (experts, top-k) pairs the tests above compile already: each new pair is a new kernel specialization, and
# compiling dozens of them would take the test's time away from launching (T, grid and routing vary per launch)
LAUNCH_SHAPES = [(8, 2), (16, 4), (64, 8), (8, 1), (16, 2)]


def test_many_launches_no_hang():
    import random

    from kosmos.kernels.moe import moe_forward

    rng = random.Random(0)
    for i in range(200):
        T = rng.randint(1, 600)
        E, k = rng.choice(LAUNCH_SHAPES)
        h, rw, gu, d = make(T, 128, 64, E, torch.bfloat16, seed=i)
        out = moe_forward(h, rw, None, None, gu, d, k, programs=rng.choice([None, 1, 7, 33]))[0]
        assert torch.isfinite(out).all(), i
    torch.cuda.synchronize()
    from kosmos.kernels.moe import control

    assert int(control(h.device).ctrl.abs().sum()) == 0  # every launch left the counters zeroed


def test_op_uses_fused_impl_with_env(monkeypatch):
    import kosmos

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    kosmos.reset_report()
    h, rw, gu, d = make(300, 256, 128, 8, torch.bfloat16, seed=8)
    out, logits, tpe, saved_up, ids = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, 2, "softmax", True)
    runs = kosmos.report().runtime
    assert ("moe_layer", "fused", "supported") in runs, runs
    assert logits.shape == (300, 8) and tpe.sum().item() == 600  # without EP the logits always (the backward's)
    monkeypatch.setenv("KOSMOS_FUSED_MOE", "0")
    kosmos.reset_report()
    ref, ref_logits, ref_tpe, ref_saved_up, ref_ids = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, 2,
                                                                                 "softmax", True)
    assert [k for k in kosmos.report().runtime if k[0] == "moe_layer"][0][1] == "reference"
    assert rel_err(out, ref) <= 3e-2 and rel_err(logits, ref_logits) <= 1e-2
    # both impls lay saved_up out the same way (the backward reads either): compare where the routing agrees
    assert saved_up.shape == ref_saved_up.shape == (300 * 2 + 8, 256)
    assert ids.shape == ref_ids.shape == (300, 2) and ids.dtype == ref_ids.dtype == torch.int32  # each impl's routing
    if torch.equal(tpe, ref_tpe):
        assert rel_err(saved_up, ref_saved_up) <= 1e-2


def test_compiled_tiny_qwen3_moe_runs_fused(monkeypatch):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    import kosmos
    from test_moe_pass import tiny_qwen3_moe, token_ids

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    model = tiny_qwen3_moe(torch.bfloat16).cuda().eval()
    ids = token_ids().cuda()
    # a cache hit skips the post-grad passes' records (README), as in the fifty-eighth session's second call
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        eager = model(ids).logits.float()
        torch._dynamo.reset()
        kosmos.reset_report()
        compiled = torch.compile(model, backend="kosmos")
        out = compiled(ids).logits.float()
    runs = kosmos.report().runtime
    moe_runs = {k: n for k, n in runs.items() if k[0] == "moe_layer"}
    assert moe_runs and all(k[1] == "fused" for k in moe_runs), runs
    assert rel_err(out, eager) <= 3e-2
    # no backward in this graph: the op runs without its saved up rows (kosmos.passes.unused_saved_up)
    assert [r.graph for r in kosmos.report().records if r.kind == "saved_up_skipped"] == ["inference"] * len(
        model.model.layers)


def test_fused_op_without_saved_up(monkeypatch):
    """save_up=False on the fused forward: saved_up comes back [0, 2I], the other outputs are the bits of a run with
    it."""
    import kosmos

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    h, rw, gu, d = make(700, 256, 128, 8, torch.bfloat16, seed=10)
    kosmos.reset_report()
    full = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, 2, "softmax", True)
    bare = torch.ops.kosmos.moe_layer(h, rw, None, None, gu, d, 2, "softmax", True, save_up=False)
    assert all(k[1] == "fused" for k in kosmos.report().runtime if k[0] == "moe_layer"), kosmos.report().runtime
    assert tuple(full[3].shape) == (700 * 2 + 8, 256) and tuple(bare[3].shape) == (0, 256)
    for i in (0, 1, 2, 4):
        assert torch.equal(full[i], bare[i]), i


# ----------------------------------------------------------------------------------------------- saved_up


@pytest.fixture
def nan_workspaces(monkeypatch):
    """torch.empty fills every floating-point tensor it makes with NaN (the launcher's workspaces and outputs)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def saved_up_reference(h, ids, gu):
    """saved_up from the routing `ids` by a loop over the experts: a zero row, then the expert's tokens in ascending
    order; a pair's row = hidden[t] (cast to gate_up_proj's dtype W) @ gate_up_proj[e].T in fp32, rounded to W."""
    E, two_i, _ = gu.shape
    x = h.to(gu.dtype).float()
    groups = []
    for e in range(E):
        toks = (ids == e).any(dim=1).nonzero().flatten()
        groups += [torch.zeros(1, two_i, device=h.device), x[toks] @ gu[e].float().T]
    return torch.cat(groups).to(gu.dtype)


def run_saved_up(h, rw, gu, d, top_k, router_bias=None, programs=None):
    """moe_forward with save_up; checks saved_up (shape, exact-zero pad rows, no row left unwritten, values against
    saved_up_reference) and that a run without save_up gives the same bits. Returns (out, tpe, saved_up, ids)."""
    from kosmos.kernels.moe import moe_forward

    E, two_i, _ = gu.shape
    res = moe_forward(h, rw, router_bias, None, gu, d, top_k, return_router_logits=True, return_routing=True,
                      save_up=True, programs=programs)
    plain = moe_forward(h, rw, router_bias, None, gu, d, top_k, return_router_logits=True, return_routing=True,
                        programs=programs)
    torch.cuda.synchronize()
    out, logits, tpe, saved, ids, w = res
    for a, b in zip(plain, (out, logits, tpe, ids, w)):
        assert torch.equal(a, b), "save_up changed the results"
    assert saved.dtype == gu.dtype and tuple(saved.shape) == (ids.numel() + E, two_i)
    pads = torch.cumsum(tpe.long(), 0) - tpe.long() + torch.arange(E, device=h.device)
    assert torch.equal(saved[pads], torch.zeros(E, two_i, dtype=saved.dtype, device=h.device)), "pad rows not zero"
    assert torch.isfinite(saved).all(), "rows left unwritten"
    err = rel_err(saved, saved_up_reference(h, ids.long(), gu))
    assert err <= TOL[gu.dtype], err
    return out, tpe, saved, ids


@pytest.mark.parametrize("dtype,T,H,I,E,k", [
    (torch.bfloat16, 300, 256, 128, 8, 2),  # T, T*k not multiples of BM = 128
    (torch.bfloat16, 257, 128, 64, 64, 8),
    (torch.bfloat16, 129, 256, 192, 16, 4),  # 3 I-chunks of 64
    (torch.bfloat16, 7, 128, 64, 8, 2),  # 14 pairs: most experts without a token
    (torch.float32, 300, 256, 128, 8, 2),
])
def test_saved_up_matches_reference(nan_workspaces, dtype, T, H, I, E, k):
    h, rw, gu, d = make(T, H, I, E, dtype, seed=T + 1)
    run_saved_up(h, rw, gu, d, k)


def test_saved_up_empty_experts_and_skew(nan_workspaces):
    h, rw, gu, d = make(513, 256, 128, 16, torch.bfloat16, seed=4)
    bias = torch.zeros(16, device="cuda", dtype=torch.bfloat16)
    bias[[0, 5, 9, 15]] = -60.0  # never chosen: the first and the last expert among them
    bias[3] = 30.0  # every token's first choice
    _, tpe, _, _ = run_saved_up(h, rw, gu, d, 2, router_bias=bias)
    assert tpe[[0, 5, 9, 15]].tolist() == [0, 0, 0, 0]
    assert tpe[3].item() == 513


def test_saved_up_all_tokens_on_one_expert_top1(nan_workspaces):
    h, rw, gu, d = make(1000, 256, 128, 8, torch.bfloat16, seed=5)
    bias = torch.zeros(8, device="cuda", dtype=torch.bfloat16)
    bias[6] = 60.0
    _, tpe, _, _ = run_saved_up(h, rw, gu, d, 1, router_bias=bias)
    assert tpe.tolist() == [0, 0, 0, 0, 0, 0, 1000, 0]


def test_saved_up_bit_identical_over_grid_sizes():
    from kosmos.kernels.moe import moe_forward

    h, rw, gu, d = make(2000, 512, 256, 32, torch.bfloat16, seed=6)
    first = moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True, save_up=True)
    for programs in (1, 3, 17, None):
        for _ in range(2):
            again = moe_forward(h, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True,
                                save_up=True, programs=programs)
            for a, b in zip(first, again):
                assert torch.equal(a, b), programs


def _option_keeps_bits(option: dict, seed: int, base_option: dict = None, column_slice: bool = False):
    """moe_forward with MoeConfig fields `option` gives the same bits as with `base_option` (forward_configs' first
    config otherwise), with saved up rows, on a Qwen3-like layer over grid sizes and a DeepSeek-V3-like one (fp32
    router, RGEMM, two fold groups); I = 320 leaves a ragged last chunk; column_slice: hidden with row stride != H."""
    import dataclasses

    from kosmos.kernels import moe

    h, rw, gu, d = make(3000, 1024, 320, 64, torch.bfloat16, seed=seed)
    if column_slice:
        h = torch.nn.functional.pad(h, (0, 64))[:, :1024]
    base = dataclasses.replace(moe.forward_configs(h, gu)[0], **(base_option or {}))
    kw = dict(return_router_logits=True, return_routing=True, save_up=True)
    first = moe.moe_forward(h, rw, None, None, gu, d, 8, config=base, **kw)
    for programs in (None, 7):
        again = moe.moe_forward(h, rw, None, None, gu, d, 8, config=dataclasses.replace(base, **option),
                                programs=programs, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a, b), programs
    cfg = dataclasses.replace(base, fold_groups=2, router_gemm=1)
    args = (h, rw.float(), None, torch.zeros(64, device="cuda"), gu, d, 8)
    kw.update(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5, router_dtype=torch.float32)
    first = moe.moe_forward(*args, config=cfg, **kw)
    again = moe.moe_forward(*args, config=dataclasses.replace(cfg, **option), **kw)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_joint_gate_up_bit_identical():
    """MoeConfig.joint_gate_up (one wgmma of width 2*BI for the gate and up blocks): the same bits as two dots of
    width BI (wgmma sums each output element over K the same way whatever the tile width)."""
    _option_keeps_bits(dict(joint_gate_up=True), seed=9, base_option=dict(joint_gate_up=False))


def test_gather_up_bit_identical():
    """MoeConfig.gather_up (the UP tiles' x rows loaded from hidden through the sorted row -> token map, no x_sorted
    copy): the same bits as the default, hidden a column slice (row stride != H)."""
    _option_keeps_bits(dict(gather_up=True), seed=11, column_slice=True)


@pytest.mark.parametrize("group_blocks", [4, 16])
def test_group_blocks_bit_identical(group_blocks):
    """UP / DOWN tasks claimed G blocks at a time (MoeConfig.group_blocks): the same bits as block by block, with
    saved up rows, on a Qwen3-like layer and a DeepSeek-V3-like one (fp32 router, RGEMM, two fold groups)."""
    import dataclasses

    from kosmos.kernels import moe

    h, rw, gu, d = make(3000, 1024, 384, 64, torch.bfloat16, seed=8)
    base = dataclasses.replace(moe.forward_configs(h, gu)[0], group_blocks=1)
    kw = dict(return_router_logits=True, return_routing=True, save_up=True)
    first = moe.moe_forward(h, rw, None, None, gu, d, 8, config=base, **kw)
    again = moe.moe_forward(h, rw, None, None, gu, d, 8, config=dataclasses.replace(base, group_blocks=group_blocks),
                            **kw)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    cfg = dataclasses.replace(base, fold_groups=2, router_gemm=1)
    args = (h, rw.float(), None, torch.zeros(64, device="cuda"), gu, d, 8)
    kw.update(scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5, router_dtype=torch.float32)
    first = moe.moe_forward(*args, config=cfg, **kw)
    again = moe.moe_forward(*args, config=dataclasses.replace(cfg, group_blocks=group_blocks), **kw)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_plans_launch_tritons_own_build(monkeypatch):
    """A kept plan (kosmos.kernels.launch_plan) launches the build Triton's own binding picks for the call's
    arguments: for hidden states 16-byte aligned and 8 bytes off (another specialization, so another plan), on a
    second call of each signature; and the two give the same bits."""
    from kosmos.kernels import launch_plan, moe

    launched = []
    direct = moe._Control.launch_direct
    monkeypatch.setattr(moe._Control, "launch_direct",
                        lambda self, launch, args: launched.append((launch, args)) or direct(self, launch, args))
    moe._plans.clear()
    h, rw, gu, d = make(777, 256, 128, 16, torch.bfloat16, seed=31)
    buf = torch.empty(777 * 256 + 4, dtype=h.dtype, device="cuda")
    shifted = buf[4:].view(777, 256)
    shifted.copy_(h)
    assert shifted.data_ptr() % 16 == 8
    results = []
    for x in (h, shifted, h, shifted):
        results.append(moe.moe_forward(x, rw, None, None, gu, d, 4, return_router_logits=True, return_routing=True,
                                       save_up=True))
    assert len(moe._plans) == 2 and len(launched) == 4
    builds = []
    for launch, args in launched:
        plan = next(p for p in moe._plans._plans.values() if p.launch is launch)
        own = launch_plan.compiled_build(moe.moe_forward_kernel, plan.grid, args, plan.meta)
        assert own is launch.compiled
        builds.append(own)
    assert builds[0] is builds[2] and builds[1] is builds[3] and builds[0] is not builds[1]
    for res in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], res))
