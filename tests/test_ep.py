"""Expert parallelism (EP): kosmos.parallelize(..., expert_parallel=True) and the EP reference impl of the MoE ops.

* sharding (in process, on a fake process group): which rank keeps which experts, the recorded split, errors;
* the ops over gloo (2 and 4 processes): `kosmos::moe_layer` / `moe_experts` with ep_group_name against the
  unsharded op on the same tokens, forward and every gradient, random and skewed routing (every token to one
  rank's experts, experts without tokens, ranks with different token counts);
* tiny HF models over gloo: eager and `torch.compile(backend="kosmos")` EP models against the unsharded eager
  model (loss and every gradient, fp32 rel err <= 1e-5), the MoE pass's EP moe_layer, AdamW steps, and the
  sharded state_dict round trip / full_state_dict;
* the fused EP path's gate over gloo (kosmos.kernels.moe_ops, device and group checks switched off): every rank of
  the group reaches the same verdict (token counts that differ, a rank without tokens or with weights the kernel
  refuses), and fake tensors (compile time) are judged without a collective.
"""
from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.distributed as dist

from _dist import SEQ, VOCAB, ep_grad_errors, run_ranks, tiny_hf_model

TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# Sharding on a fake process group (no data moves: broadcasts are no-ops, so each rank keeps a slice of its own
# weights)


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int):
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return init_device_mesh("cpu", (world,))

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sharding_keeps_contiguous_local_experts(fake_world, family):
    import kosmos
    from torch.distributed.tensor import DTensor

    rank, world = 1, 2
    mesh = fake_world(rank, world)
    model = tiny_hf_model(family, num_key_value_heads=4) if family == "deepseek_v3" else tiny_hf_model(family)
    full = copy.deepcopy(model)
    kosmos.parallelize(model, mesh, expert_parallel=True)
    moe = model.model.layers[1].mlp
    full_moe = full.model.layers[1].mlp
    group = mesh.get_group().group_name
    assert moe.experts._kosmos_ep == (group, 2, 2)
    assert type(moe.experts).__name__.startswith("ExpertParallel")
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(moe.experts, name)
        assert type(p) is torch.nn.Parameter and not isinstance(p, DTensor)
        assert p._kosmos_ep == (group, 2, 2)
        assert p.shape[0] == 2 and torch.equal(p, getattr(full_moe.experts, name)[2:4])
        assert not hasattr(p, "_kosmos_grad_allreduce")
    # the router and the shared experts stay replicated, gradients summed over the group
    assert moe.gate.weight.shape == full_moe.gate.weight.shape and moe.gate.weight._kosmos_grad_allreduce == group
    if family == "deepseek_v3":
        assert moe.shared_experts.gate_proj.weight._kosmos_grad_allreduce == group
    plan = model._kosmos_tp
    assert plan.expert_parallel
    assert plan.expert_sharded == ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]
    assert "model.layers.1.mlp.experts.gate_up_proj" not in plan.grad_allreduce
    assert "EP" in plan.styles["model.layers.1.mlp"]
    # the sharded state_dict holds the local experts
    sd = model.state_dict()
    assert sd["model.layers.1.mlp.experts.gate_up_proj"].shape == (2, 64, 64)


def test_sharding_errors(fake_world):
    import kosmos

    mesh = fake_world(0, 2)
    with pytest.raises(ValueError, match="experts.*divisible by the TP size 2"):
        kosmos.parallelize(tiny_hf_model("qwen3_moe", num_experts=3), mesh, expert_parallel=True)
    model = tiny_hf_model("qwen3_moe")
    model.model.layers[1].mlp.experts.has_bias = True  # an experts form kosmos::moe_experts does not run
    with pytest.raises(ValueError, match="cannot be expert-sharded: experts with biases"):
        kosmos.parallelize(model, mesh, expert_parallel=True)
    # without EP the experts stay whole
    model = kosmos.parallelize(tiny_hf_model("qwen3_moe", num_experts=3), mesh)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape[0] == 3 and not model._kosmos_tp.expert_parallel


def test_op_checks_ep_arguments():
    import kosmos.ops.moe  # noqa: F401

    h, w = torch.randn(4, 8), torch.randn(4, 8)
    gu, d = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    with pytest.raises(ValueError, match="needs an ep_group_name"):
        torch.ops.kosmos.moe_layer(h, w, None, None, gu, d, 2, "softmax", True, ep_world_size=2)
    with pytest.raises(ValueError, match=r"router_weight must be \[E=8"):  # 2 local experts x 4 ranks
        torch.ops.kosmos.moe_layer(h, w, None, None, gu, d, 2, "softmax", True, ep_group_name="g", ep_world_size=4)
    with pytest.raises(ValueError, match="ep_mode must be one of"):
        torch.ops.kosmos.moe_layer(h, w, None, None, gu, d, 2, "softmax", True, ep_mode="ring")
    with pytest.raises(ValueError, match="ep_mode='all_reduce' needs an ep_group_name"):
        torch.ops.kosmos.moe_layer(torch.randn(4, 8), torch.randn(2, 8), None, None, gu, d, 2, "softmax", True,
                                   ep_mode="all_reduce")


# ---------------------------------------------------------------------------------------------
# The ops over gloo: EP reference vs the unsharded op

H, I = 16, 8


def _op_inputs(world: int, case: str):
    """Inputs of every rank (same generator on every rank): tokens per rank, full weights."""
    g = torch.Generator().manual_seed(7)
    num_experts = 8 if world == 4 else 4
    tokens = [torch.randn(5 + 2 * r, H, generator=g) for r in range(world)]
    router = torch.randn(num_experts, H, generator=g)
    gate_up = torch.randn(num_experts, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(num_experts, H, I, generator=g) / I ** 0.5
    bias = torch.randn(num_experts, generator=g)
    grads = [torch.randn(t.shape, generator=g) for t in tokens]
    logits_grads = [torch.randn(t.shape[0], num_experts, generator=g) for t in tokens]
    if case == "skewed":  # every token to rank 0's experts (top-2 of its E_loc >= 2); the others get nothing
        bias = torch.full((num_experts,), -30.0)
        bias[: num_experts // world] = 30.0
    return tokens, router, gate_up, down, bias, grads, logits_grads


_LAYER_CASES = {
    # name: (routing case, moe_layer router arguments)
    "softmax": ("random", dict(top_k=2, scoring="softmax", norm_topk_prob=True)),
    "softmax_logits_bias": ("random", dict(top_k=2, scoring="softmax", norm_topk_prob=False, router_bias=True,
                                           return_router_logits=True)),
    "sigmoid_grouped": ("random", dict(top_k=2, scoring="sigmoid", norm_topk_prob=True, n_group=2, topk_group=1,
                                       routed_scaling_factor=2.5, correction=True)),
    "skewed_one_rank": ("skewed", dict(top_k=2, scoring="softmax", norm_topk_prob=True, router_bias=True)),
}


def _layer_grads(hidden, router, bias, gate_up, down, grad, logits_grad, cfg, ep):
    cfg = dict(cfg)
    use_bias, correction = cfg.pop("router_bias", False), cfg.pop("correction", False)
    leaves = [hidden.clone().requires_grad_(), router.clone().requires_grad_(), gate_up.clone().requires_grad_(),
              down.clone().requires_grad_()]
    rb = bias.clone().requires_grad_() if use_bias else None
    out, logits, counts, _, _ = torch.ops.kosmos.moe_layer(
        leaves[0], leaves[1], rb, bias.abs() if correction else None, leaves[2], leaves[3], **cfg,
        ep_group_name=ep[0], ep_world_size=ep[1], ep_mode=ep[2] if len(ep) > 2 else "all_to_all")
    loss = (out * grad).sum() + ((logits * logits_grad).sum() if cfg.get("return_router_logits") else 0)
    grads = torch.autograd.grad(loss, leaves + ([rb] if rb is not None else []))
    return out.detach(), counts, list(grads)


def _op_suite(rank: int, world: int) -> dict:
    import kosmos.ops.moe  # noqa: F401

    group = dist.group.WORLD.group_name
    errs = {}
    for name, (routing, cfg) in _LAYER_CASES.items():
        tokens, router, gate_up, down, bias, grads, logits_grads = _op_inputs(world, routing)
        num_local = gate_up.shape[0] // world
        mine = slice(rank * num_local, (rank + 1) * num_local)
        out, counts, g = _layer_grads(tokens[rank], router, bias, gate_up[mine], down[mine], grads[rank],
                                      logits_grads[rank], cfg, (group, world))
        refs = [_layer_grads(tokens[r], router, bias, gate_up, down, grads[r], logits_grads[r], cfg, (None, 1))
                for r in range(world)]
        ref_out, _, ref_g = refs[rank]
        e = {"out": _rel(out, ref_out), "d_hidden": _rel(g[0], ref_g[0]), "d_router": _rel(g[1], ref_g[1])}
        e["d_gate_up"] = _rel(g[2], sum(r[2][2] for r in refs)[mine])  # local experts: rows of every rank
        e["d_down"] = _rel(g[3], sum(r[2][3] for r in refs)[mine])
        if len(g) > 4:
            e["d_router_bias"] = _rel(g[4], ref_g[4])
        global_counts = sum(r[1] for r in refs)
        e["counts_global"] = 0.0 if torch.equal(counts, global_counts) else float("inf")
        if routing == "skewed":
            e["skewed_as_asked"] = 0.0 if global_counts[num_local:].sum() == 0 else float("inf")
        errs[name] = e

    # ep_mode="all_reduce" (transformers' AllReduceEP layout): every rank holds the same tokens (rank 0's)
    for name, (routing, cfg) in _LAYER_CASES.items():
        tokens, router, gate_up, down, bias, grads, logits_grads = _op_inputs(world, routing)
        num_local = gate_up.shape[0] // world
        mine = slice(rank * num_local, (rank + 1) * num_local)
        out, counts, g = _layer_grads(tokens[0], router, bias, gate_up[mine], down[mine], grads[0], logits_grads[0],
                                      cfg, (group, world, "all_reduce"))
        ref_out, ref_counts, ref_g = _layer_grads(tokens[0], router, bias, gate_up, down, grads[0], logits_grads[0],
                                                  cfg, (None, 1))
        e = {"out": _rel(out, ref_out), "d_hidden": _rel(g[0], ref_g[0]), "d_router": _rel(g[1], ref_g[1]),
             "d_gate_up": _rel(g[2], ref_g[2][mine]), "d_down": _rel(g[3], ref_g[3][mine]),
             "counts": 0.0 if torch.equal(counts, ref_counts) else float("inf")}
        if len(g) > 4:
            e["d_router_bias"] = _rel(g[4], ref_g[4])
        errs[f"all_reduce_{name}"] = e

    # moe_experts with given routing: every pair to the last rank's experts, rank 0 without tokens
    g = torch.Generator().manual_seed(3)
    num_experts, k = 2 * world, 2
    tokens = [torch.randn(0 if r == 0 else 3 + r, H, generator=g) for r in range(world)]
    ids = [torch.stack([torch.randperm(2, generator=g)[:k] + num_experts - 2 for _ in range(t.shape[0])])
           if t.shape[0] else torch.zeros(0, k, dtype=torch.long) for t in tokens]
    weights = [torch.rand(t.shape[0], k, generator=g) for t in tokens]
    gate_up = torch.randn(num_experts, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(num_experts, H, I, generator=g) / I ** 0.5
    grads = [torch.randn(t.shape, generator=g) for t in tokens]

    def run(r, gu, dn, ep):
        leaves = [tokens[r].clone().requires_grad_(), weights[r].clone().requires_grad_(), gu.clone().requires_grad_(),
                  dn.clone().requires_grad_()]
        out, counts = torch.ops.kosmos.moe_experts(leaves[0], ids[r], leaves[1], leaves[2], leaves[3], "silu", *ep)
        return out.detach(), counts, torch.autograd.grad((out * grads[r]).sum(), leaves, allow_unused=True)

    mine = slice(rank * 2, rank * 2 + 2)
    out, counts, gr = run(rank, gate_up[mine], down[mine], (group, world))
    refs = [run(r, gate_up, down, (None, 1)) for r in range(world)]
    e = {}
    if tokens[rank].shape[0]:
        e.update(out=_rel(out, refs[rank][0]), d_hidden=_rel(gr[0], refs[rank][2][0]),
                 d_weights=_rel(gr[1], refs[rank][2][1]))
    else:
        e["empty_rank_shapes"] = 0.0 if out.shape == (0, H) and gr[0].shape == (0, H) else float("inf")
    if rank == world - 1:
        e["d_gate_up"] = _rel(gr[2], sum(r[2][2] for r in refs)[mine])
        e["d_down"] = _rel(gr[3], sum(r[2][3] for r in refs)[mine])
    else:  # experts without tokens: zero gradients
        e["idle_experts_zero_grad"] = 0.0 if gr[2].abs().sum() == 0 and gr[3].abs().sum() == 0 else float("inf")
    e["counts_global"] = 0.0 if torch.equal(counts, sum(r[1] for r in refs)) else float("inf")
    errs["experts_skewed_empty_rank"] = e
    return errs


@functools.lru_cache(maxsize=None)
def _op_results(world: int) -> list:
    return run_ranks(_op_suite, world)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_ep_ops_match_unsharded(world):
    for rank, errs in enumerate(_op_results(world)):
        for case, e in errs.items():
            bad = {k: v for k, v in e.items() if not v <= TOL}
            assert not bad, f"world={world} rank={rank} {case}: rel err > {TOL}: {bad}"


# ---------------------------------------------------------------------------------------------
# Tiny HF models: EP (eager and compiled with kosmos) vs the unsharded eager model


def _batch(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def _grad_errors(model, ref) -> dict:
    """_dist.ep_grad_errors, plus: every gradient of a DTensor parameter is placed as the parameter, and every
    reference parameter has its error."""
    from torch.distributed.tensor import DTensor

    for name, p in model.named_parameters():
        if p.grad is not None and getattr(p, "_kosmos_ep", None) is None and isinstance(p, DTensor):
            assert p.grad.placements == p.placements, name
    errs = ep_grad_errors(model, ref)
    assert set(errs) == set(dict(ref.named_parameters()))
    return errs


def _model_case(rank: int, world: int, family: str, mode: str) -> dict:
    import kosmos
    import kosmos.parallel
    import kosmos.passes.moe as moe_pass
    from torch.distributed.device_mesh import init_device_mesh

    overrides = dict(num_key_value_heads=4) if world == 4 or family == "deepseek_v3" else {}
    if world == 4:
        overrides["num_experts" if family == "qwen3_moe" else "n_routed_experts"] = 8
    model = tiny_hf_model(family, **overrides)
    ref = copy.deepcopy(model)
    ids = _batch()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()

    mesh = init_device_mesh("cpu", (world,))
    kosmos.parallelize(model, mesh, expert_parallel=True)
    codes = []
    run = model
    if mode == "kosmos":
        torch._dynamo.reset()
        kosmos.reset_report()
        original = moe_pass.run

        def capture(gm, example_inputs, options):  # the Dynamo graph after the MoE pass
            n = original(gm, example_inputs, options)
            codes.append(gm.code)
            return n

        moe_pass.run = capture
        run = torch.compile(model, backend="kosmos")
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    out = {"loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
           "grad_errors": _grad_errors(model, ref), "ep": model.model.layers[1].mlp.experts._kosmos_ep}
    if mode == "kosmos":
        moe_pass.run = original
        report = kosmos.report()
        out["moe_records"] = [r.reason for r in report.rewrites if r.kind == "moe_layer"]
        out["codes"] = codes
        out["report"] = str(report)
        return out

    # state_dict: the sharded one round-trips into another EP model; full_state_dict is the unsharded one
    other = kosmos.parallelize(tiny_hf_model(family, seed=5, **overrides), mesh, expert_parallel=True)
    sd = model.state_dict()
    other.load_state_dict(sd)
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    out["state_dict_round_trip"] = all(torch.equal(local(v), local(sd[k])) for k, v in other.state_dict().items())
    full = kosmos.parallel.full_state_dict(model)
    if rank == 0:
        ref_sd = ref.state_dict()
        out["full_state_dict"] = set(full) == set(ref_sd) and all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
    # AdamW steps (foreach, as on CUDA: DTensor and plain parameters in separate groups): the losses of 3 steps
    losses = []
    for m, params in ((model, kosmos.parallel.param_groups(model)), (ref, ref.parameters())):
        opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)
        losses.append([])
        for _ in range(3):
            opt.zero_grad()
            step_loss = m(input_ids=ids, labels=ids).loss
            step_loss.backward()
            opt.step()
            losses[-1].append(step_loss.item())
    out["adamw_loss_err"] = max(abs(a - b) / abs(b) for a, b in zip(*losses))
    return out


def _model_suite(rank: int, world: int, cases: list) -> dict:
    return {f"{family}-{mode}": _model_case(rank, world, family, mode) for family, mode in cases}


def _check_model(name: str, r: dict) -> None:
    assert r["loss_err"] <= TOL, f"{name}: loss rel err {r['loss_err']}"
    bad = {k: v for k, v in r["grad_errors"].items() if not v <= TOL}
    assert not bad, f"{name}: gradients differ from the unsharded model's (rel err > {TOL}): {bad}"


# one spawn per world size runs its cases (~45 s each on 2 idle cores); KOSMOS_TEST_EP_QUICK=1 leaves out the
# world-4 compile (4 processes compiling on 2 cores: the slowest case)
MODEL_CASES = {
    2: [("qwen3_moe", "eager"), ("deepseek_v3", "eager"), ("qwen3_moe", "kosmos"), ("deepseek_v3", "kosmos")],
    4: [("qwen3_moe", "eager")] + ([] if os.environ.get("KOSMOS_TEST_EP_QUICK") else [("qwen3_moe", "kosmos")]),
}


@functools.lru_cache(maxsize=None)
def _model_results(world: int) -> list:
    return run_ranks(_model_suite, world, MODEL_CASES[world])


@pytest.mark.multiproc
@pytest.mark.parametrize("world,name", [(w, f"{f}-{m}") for w, cases in MODEL_CASES.items() for f, m in cases])
def test_ep_model_matches_unsharded(world, name):
    results = _model_results(world)
    for rank, res in enumerate(results):
        r = res[name]
        _check_model(f"{name} world={world} rank={rank}", r)
        if name.endswith("eager"):
            assert r["state_dict_round_trip"], f"{name}: sharded state_dict did not round-trip"
            if rank == 0:
                assert r["full_state_dict"], f"{name}: full_state_dict differs from the unsharded state_dict"
            assert r["adamw_loss_err"] <= TOL, f"{name}: AdamW step losses, rel err {r['adamw_loss_err']}"
        else:
            group, ep_world, _ = r["ep"]
            ep_records = [m for m in r["moe_records"] if f"expert parallel: group {group}, {ep_world} ranks" in m]
            assert ep_records, f"{name}: no EP moe_layer rewrite:\n{r['report']}"
            ep_call = [c for c in r["codes"] if "kosmos.moe_layer" in c and f"'{group}', {ep_world})" in c]
            assert ep_call, f"{name}: the rewritten graph has no moe_layer call with the EP group:\n{r['codes']}"
            assert not any("moe_experts" in c for c in r["codes"]), f"{name}: a moe_experts call was left"


# ---------------------------------------------------------------------------------------------
# The fused EP path's gate (kosmos.kernels.moe_ops): one verdict for the whole group, decided collectively


def _gate_suite(rank: int, world: int) -> dict:
    """why_not_moe_layer with EP over gloo, the device and group checks switched off (so CPU tensors on a gloo group
    reach the group decision; the fused kernels themselves need CUDA and an NCCL group, tests/test_multi_gpu_ep.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import kosmos.kernels.fused_ops as fused_ops
    from kosmos.kernels import moe_ops

    moe_ops._device_reason = lambda hidden: None
    fused_ops._group_reason = lambda group_name, world_size: None
    group = dist.group.WORLD.group_name
    E_loc, k = 4, 2

    def verdict(T: int, ep_mode: str = "all_to_all", misaligned: bool = False):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(T, H, generator=g)
        gu = torch.randn(E_loc, 2 * I, H, generator=g)
        down = torch.randn(E_loc, H, I, generator=g)
        if misaligned:  # the kernel's TMA descriptors refuse this rank's weights
            gu = torch.randn(gu.numel() + 1, generator=g)[1:].view(gu.shape)
        return moe_ops.why_not_moe_layer(hidden, torch.randn(E_loc * world, H, generator=g), None, None, gu, down, k,
                                         "softmax", True, ep_group_name=group, ep_world_size=world, ep_mode=ep_mode)

    out = {"same_T": verdict(8), "T_differs": verdict(8 + rank), "rank0_no_tokens": verdict(0 if rank == 0 else 8),
           "last_rank_misaligned": verdict(8, misaligned=rank == world - 1), "all_reduce": verdict(8, "all_reduce")}
    calls = []
    agree = moe_ops._agree
    moe_ops._agree = lambda *a: calls.append(a) or agree(*a)
    with FakeTensorMode():  # the MoE pass's planned impl: judged on this rank's arguments, no collective
        out["fake_T_differs"] = verdict(8 + rank)
    out["fake_collectives"] = len(calls)
    out["after_fake"] = verdict(8)  # the group is still in step
    out["group"] = group
    return out


@pytest.mark.multiproc
def test_fused_ep_gate_decides_for_the_whole_group():
    world = 2
    for rank, v in enumerate(run_ranks(_gate_suite, world)):
        assert v["same_T"] is None and v["after_fake"] is None, v
        assert "different token counts (T from 8 to 9, here" in v["T_differs"], v
        assert v["rank0_no_tokens"] == ("no tokens (T == 0)" if rank == 0 else f"another rank of EP group "
                                        f"{v['group']!r} refused the fused kernel (its report says why)"), v
        want = "not 16-byte aligned" if rank == world - 1 else "another rank of EP group"
        assert want in v["last_rank_misaligned"], v
        assert "implement the all_to_all layout" in v["all_reduce"], v
        assert v["fake_T_differs"] is None and v["fake_collectives"] == 0, v
