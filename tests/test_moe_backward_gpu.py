"""The fused MoE backward kernel (kosmos.kernels.moe_backward) on one CUDA GPU (sm_90+) against the reference
`moe_layer_backward` math of kosmos.ops.moe: bf16 / fp32 (and fp16), ragged T, empty experts, skewed routing, top-1,
router bias / scaling / no renorm / grad_router_logits, sigmoid (DeepSeek-V3) routing, bit-identical reruns over grid
sizes, a CUDA graph replayed on changing inputs, counters left zeroed after many launches, torch.compile of a
tiny HF Qwen3-MoE TRAINING step with KOSMOS_FUSED_MOE=1 where both directions report the fused impl, and the same
model's training steps under Inductor's CUDA graph trees (default mode).

The backward recomputes the routing on the GPU; a near-tie between two experts may resolve differently from the
reference's torch routing, which would change whole rows of the gradients without being an error of the backward.
So the reference gradients are computed on the KERNEL's routing (moe_backward(return_routing=True)): the reference
router state (logits, scores) with the kernel's top-k ids; the routing itself is compared separately (the ids equal
the reference's on all but a few near-tied rows).
Passed on an H200 (2026-11-29; benchmarks/RESULTS.md).
"""
from __future__ import annotations

import pytest
import torch

from _moe_gpu import MARKS, exact_fp32, rel_err, spin_bound  # noqa: F401  (autouse fixtures)

pytestmark = MARKS

from kosmos.kernels import runtime  # noqa: E402

NAMES = ["d_hidden", "d_router_weight", "d_gate_up_proj", "d_down_proj", "d_router_bias"]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def make(T, H, I, E, dtype, seed=0, router_scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    rw = (torch.randn(E, H, device="cuda", generator=g) * router_scale / H ** 0.5).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dtype)
    d = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dtype)
    go = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    return h, rw, gu, d, go


def _with_ids(routed, ids, norm, scoring, rsf):
    """_route_forward's result with the top-k ids replaced (the reference math after the selection)."""
    logits, _, _, st = routed
    raw = st["scores"].gather(1, ids)
    normed, denominator = raw, None
    if norm:
        denominator = raw.sum(dim=-1, keepdim=True)
        if scoring == "sigmoid":
            denominator = denominator + 1e-20
        normed = raw / denominator
    weights = normed * rsf if st["scaled"] else normed
    return logits, ids, weights.to(logits.dtype), dict(st, normed=normed, denominator=denominator)


def reference(go, glog, h, rw, rb, cb, gu, d, k, scoring="softmax", norm=True, n_group=1, topk_group=1, rsf=1.0,
              router_dtype=None, ids=None):
    """moe_layer_backward's reference math; with `ids`, on that routing instead of the reference's own."""
    from kosmos.ops.moe_math import _route_forward, experts_backward, route_backward

    routed = _route_forward(h, rw, rb, cb, k, scoring, norm, n_group, topk_group, rsf, router_dtype)
    if ids is not None:
        routed = _with_ids(routed, ids, norm, scoring, rsf)
    _, ids, weights, _ = routed
    d_hidden, d_weights, d_gu, d_down = experts_backward(go, h, ids, weights, gu, d)
    d_hidden_router, d_rw, d_rb = route_backward(d_weights, glog, routed, rw, rb, scoring, rsf)
    grads = [(d_hidden + d_hidden_router).to(h.dtype), d_rw, d_gu, d_down]
    return grads + ([d_rb] if rb is not None else []), ids


def run_and_check(h, rw, gu, d, go, k, *, glog=None, router_bias=None, correction=None, scoring="softmax", norm=True,
                  n_group=1, topk_group=1, rsf=1.0, router_dtype=None, programs=None, tol=None, tols=None,
                  max_flipped_rows=2):
    from kosmos.kernels.moe_backward import moe_backward

    got, (kid, _) = moe_backward(go, glog, h, rw, router_bias, correction, gu, d, k, scoring, norm, n_group,
                                 topk_group, rsf, router_dtype, programs=programs, return_routing=True)
    torch.cuda.synchronize()
    _, own_ids = reference(go, glog, h, rw, router_bias, correction, gu, d, k, scoring, norm, n_group, topk_group,
                           rsf, router_dtype)
    flipped = (kid.long().sort(dim=1).values != own_ids.sort(dim=1).values).any(dim=1).sum().item()
    assert flipped <= max_flipped_rows, f"{flipped} tokens routed differently from the reference"
    ref, _ = reference(go, glog, h, rw, router_bias, correction, gu, d, k, scoring, norm, n_group, topk_group, rsf,
                       router_dtype, ids=kid.long())
    assert len(got) == len(ref)
    tol = tol or TOL[gu.dtype]
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
        assert torch.isfinite(a).all(), name
        err = rel_err(a, b)
        assert err <= (tols or {}).get(name, tol), (name, err)
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H,I,E,k", [(300, 256, 128, 8, 2), (1000, 512, 192, 16, 4), (257, 128, 64, 64, 8)])
def test_matches_reference(dtype, T, H, I, E, k):
    h, rw, gu, d, go = make(T, H, I, E, dtype, seed=T)
    run_and_check(h, rw, gu, d, go, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top1_bias_scaling_no_renorm_router_fp32_glog(dtype):
    h, rw, gu, d, go = make(333, 256, 128, 8, dtype, seed=3)
    bias = torch.linspace(-0.2, 0.2, 8, device="cuda").to(dtype)
    glog = torch.randn(333, 8, device="cuda")  # logits dtype fp32
    run_and_check(h, rw, gu, d, go, 1, router_bias=bias, norm=False, rsf=2.5, router_dtype=torch.float32, glog=glog)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deepseek_v3_router(dtype):
    h, rw, gu, d, go = make(600, 256, 128, 64, dtype, seed=9)
    corr = torch.linspace(-0.05, 0.05, 64, device="cuda")
    run_and_check(h, rw, gu, d, go, 8, scoring="sigmoid", correction=corr, n_group=8, topk_group=4, rsf=2.5,
                  router_dtype=torch.float32)


def test_sigmoid_bf16_router_bias_glog():
    h, rw, gu, d, go = make(300, 256, 128, 16, torch.bfloat16, seed=10)
    bias = torch.linspace(-0.1, 0.1, 16, device="cuda").to(torch.bfloat16)
    glog = torch.randn(300, 16, device="cuda").to(torch.bfloat16)
    run_and_check(h, rw, gu, d, go, 2, scoring="sigmoid", router_bias=bias, glog=glog,
                  tols={"d_router_weight": 5e-2, "d_router_bias": 5e-2})


def test_empty_experts_and_skew():
    h, rw, gu, d, go = make(513, 256, 128, 16, torch.bfloat16, seed=4)
    bias = torch.zeros(16, device="cuda", dtype=torch.bfloat16)
    bias[[1, 5, 9, 10]] = -60.0  # never chosen: their weight gradients are zeros
    bias[3] = 30.0  # every token's first choice
    got = run_and_check(h, rw, gu, d, go, 2, router_bias=bias, tols={"d_router_weight": 5e-2, "d_router_bias": 5e-2})
    assert got[2][[1, 5, 9, 10]].abs().sum().item() == 0 and got[3][[1, 5, 9, 10]].abs().sum().item() == 0


def test_all_tokens_on_one_expert_top1():
    h, rw, gu, d, go = make(1000, 256, 128, 8, torch.bfloat16, seed=5)
    bias = torch.zeros(8, device="cuda", dtype=torch.bfloat16)
    bias[6] = 60.0
    # saturated softmax, top-1, renorm: the router gradients are exactly ~0; only the experts' are compared
    run_and_check(h, rw, gu, d, go, 1, router_bias=bias, tols={"d_router_weight": float("inf"),
                                                               "d_router_bias": float("inf")})


@pytest.mark.parametrize("T", [1, 7, 65, 129])
def test_small_and_ragged_T(T):
    h, rw, gu, d, go = make(T, 128, 64, 8, torch.bfloat16, seed=T)
    run_and_check(h, rw, gu, d, go, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_identical_over_grid_sizes(dtype):
    from kosmos.kernels.moe_backward import moe_backward

    h, rw, gu, d, go = make(2000, 512, 256, 32, dtype, seed=6)
    rb = torch.linspace(-0.1, 0.1, 32, device="cuda").to(dtype)
    glog = torch.randn(2000, 32, device="cuda").to(dtype)
    first = moe_backward(go, glog, h, rw, rb, None, gu, d, 4)
    for programs in (1, 3, 17, None, runtime.num_sms(h.device)):
        for _ in range(2):
            again = moe_backward(go, glog, h, rw, rb, None, gu, d, 4, programs=programs)
            for name, a, b in zip(NAMES, first, again):
                assert torch.equal(a, b), (name, programs)


def test_cuda_graph_replay_with_changing_inputs():
    from kosmos.kernels.moe_backward import moe_backward

    T, H, I, E, k = 700, 256, 128, 16, 2
    h, rw, gu, d, go = make(T, H, I, E, torch.bfloat16, seed=7)
    static_h, static_go = h.clone(), go.clone()
    moe_backward(static_go, None, static_h, rw, None, None, gu, d, k)  # warm up: compile, grow the control tensor
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_grads = moe_backward(static_go, None, static_h, rw, None, None, gu, d, k)
    for step in range(20):
        new_h, _, _, _, new_go = make(T, H, I, E, torch.bfloat16, seed=100 + step)
        if step % 5 == 4:  # skew the routing between replays
            new_h = new_h + rw[step % E].float().to(new_h.dtype) * 8
        static_h.copy_(new_h)
        static_go.copy_(new_go)
        for g in g_grads:
            g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = moe_backward(new_go, None, new_h, rw, None, None, gu, d, k)
        for name, a, b in zip(NAMES, g_grads, eager):
            assert torch.equal(a, b), (name, step)


# (experts, top-k) pairs the tests above compile already: each new pair is a new kernel specialization, and
# compiling dozens of them would take the test's time away from launching (T, grid and routing vary per launch)
LAUNCH_SHAPES = [(8, 2), (16, 4), (64, 8), (8, 1), (16, 2)]


def test_many_launches_no_hang():
    import random

    from kosmos.kernels.moe_backward import control, moe_backward

    rng = random.Random(0)
    for i in range(200):
        T = rng.randint(1, 600)
        E, k = rng.choice(LAUNCH_SHAPES)
        h, rw, gu, d, go = make(T, 128, 64, E, torch.bfloat16, seed=i)
        grads = moe_backward(go, None, h, rw, None, None, gu, d, k, programs=rng.choice([None, 1, 7, 33]))
        assert all(torch.isfinite(g).all() for g in grads), i
    torch.cuda.synchronize()
    assert int(control(h.device).ctrl.abs().sum()) == 0  # every launch left the counters zeroed


def test_op_uses_fused_impl_with_env(monkeypatch):
    import kosmos

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    kosmos.reset_report()
    h, rw, gu, d, go = make(300, 256, 128, 8, torch.bfloat16, seed=8)
    # saved_up as the autograd path passes it when nothing was saved: an empty tensor (the op mutates saved_up, and
    # with None or the argument left out, torch 2.11's custom-op version bump indexes a missing positional)
    args = (go, None, h, rw, None, None, gu, d, 2, "softmax", True, 1, 1, 1.0, None, "silu", None, 1, "all_to_all",
            None, None, gu.new_empty(0, gu.shape[1]))
    fused = torch.ops.kosmos.moe_layer_backward(*args)
    runs = kosmos.report().runtime
    assert ("moe_layer_backward", "fused", "supported") in runs, runs
    monkeypatch.setenv("KOSMOS_FUSED_MOE", "0")
    kosmos.reset_report()
    ref = torch.ops.kosmos.moe_layer_backward(*args)
    assert [k for k in kosmos.report().runtime if k[0] == "moe_layer_backward"][0][1] == "reference"
    for name, a, b in zip(NAMES, fused, ref):
        assert rel_err(a, b) <= 5e-2, name  # a near-tie may flip a row's routing between the two


def test_compiled_tiny_qwen3_moe_training_step_runs_fused(monkeypatch):
    pytest.importorskip("transformers")
    import kosmos
    from test_moe_pass import tiny_qwen3_moe, token_ids

    monkeypatch.setenv("KOSMOS_FUSED_MOE", "1")
    ids = token_ids().cuda()

    def step(model, params):
        params.zero_grad(set_to_none=True)
        logits = model(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad.detach().float().clone() for n, p in params.named_parameters()
                               if p.grad is not None}

    eager_model = tiny_qwen3_moe(torch.float32).cuda().train()
    eager_loss, eager_grads = step(eager_model, eager_model)
    model = tiny_qwen3_moe(torch.float32).cuda().train()  # the same seed: the same weights
    torch._dynamo.reset()
    kosmos.reset_report()
    compiled = torch.compile(model, backend="kosmos")
    loss, grads = step(compiled, model)  # names from the module itself (the compiled one adds _orig_mod.)
    runs = kosmos.report().runtime
    fwd = {k for k in runs if k[0] == "moe_layer"}
    bwd = {k for k in runs if k[0] == "moe_layer_backward"}
    assert fwd and all(k[1] == "fused" for k in fwd), runs
    assert bwd and all(k[1] == "fused" for k in bwd), runs
    assert abs(loss.item() - eager_loss.item()) <= 1e-4 * max(1.0, abs(eager_loss.item()))
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, eager_grads[name]) <= 1e-3, name


@pytest.mark.parametrize("graphed_first", [False, True])
def test_compiled_training_steps_under_cuda_graph_trees(monkeypatch, graphed_first):
    """backend="kosmos" with options={"inductor_config": {"triton.cudagraphs": True}} (what benchmarks/moe.py
    --cudagraphs times), bf16 (the default backward's grouped matmuls are CUTLASS's there: no host sync; fp32's
    per-expert loop reads the group sizes on the host and cannot be captured): Inductor's CUDA graph trees take the
    kosmos graphs (no cudagraph skip: the backward's in-place write into saved_up is a write into a tensor the
    forward's graph recorded), and replays with new token ids give the loss and grads of the same model compiled
    without CUDA graphs (same kernels, same routing) at every step, the forward's fused impl recorded.
    graphed_first: the kernels' control tensors are first made inside the graph trees' warm-up, whose thread
    allocates into the graph pool (runtime.kept_tensor keeps them out: the trees refuse an untracked pool tensor)."""
    pytest.importorskip("transformers")
    import kosmos
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    from test_moe_pass import tiny_qwen3_moe

    monkeypatch.delenv("KOSMOS_FUSED_MOE", raising=False)
    if graphed_first:
        import kosmos.kernels.moe as moe_kernels

        monkeypatch.setattr(moe_kernels, "_controls", {})
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 8), generator=g).cuda() for _ in range(4)]

    def step(model, params, ids):
        params.zero_grad(set_to_none=True)
        logits = model(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach().clone(), {n: p.grad.detach().float().clone() for n, p in params.named_parameters()
                                       if p.grad is not None}

    torch._dynamo.reset()
    counters.clear()
    kosmos.reset_report()
    plain_model = tiny_qwen3_moe(torch.bfloat16).cuda().train()
    graph_model = tiny_qwen3_moe(torch.bfloat16).cuda().train()  # the same seed: the same weights
    plain = torch.compile(plain_model, backend="kosmos")
    graphed = torch.compile(graph_model, backend="kosmos", options={"inductor_config": {"triton.cudagraphs": True}})
    for i, ids in enumerate(batches):
        if not graphed_first:
            want_loss, want_grads = step(plain, plain_model, ids)
        torch.compiler.cudagraph_mark_step_begin()
        loss, grads = step(graphed, graph_model, ids)
        if graphed_first:
            want_loss, want_grads = step(plain, plain_model, ids)
        assert abs(loss.item() - want_loss.item()) <= 1e-3 * max(1.0, abs(want_loss.item())), i
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            assert rel_err(grad, want_grads[name]) <= 1e-2, (i, name)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and manager.roots, "no CUDA graph was recorded"
    runs = kosmos.report().runtime
    fwd = {k for k in runs if k[0] == "moe_layer"}
    assert fwd and all(k[1] == "fused" for k in fwd), runs
