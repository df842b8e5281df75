"""Rank functions of tests/test_multi_gpu_ep.py, run by _dist.run_ranks over NCCL (rank r on cuda:r): the
expert-parallel kosmos::moe_layer / moe_layer_backward on a real group (fused EP kernels against the unsharded
reference op), the launcher's hooks, a compiled HF Qwen3-MoE proxy under kosmos.parallelize(expert_parallel=True),
and a missing signal. Each case returns numbers and flags and the test module asserts on them: a rank raises only on
a real error, never on a failed check, so a check cannot leave its peers waiting in a collective.

Routing without near-ties: bf16 logits rounded by two different kernels can pick different experts on a near-tie,
which would make the fused and reference outputs differ by whole rows. The "structured" router gives exact logits
instead: router_weight = [identity | 0], so logits[t] = hidden[t, :E], and hidden[t, :E] holds a permutation of E
distinct values 1/8 apart (exact in bf16 and tf32): random per token ("random" routing), or the largest values always
on the hot experts ("hot" routing: those experts take every token, the others none). The fp32 case uses a plain
random router (fp32 logits differ in the last bits at most).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import json
import math
import time

import torch
import torch.distributed as dist

from kosmos.kernels.moe_ops import fused_env

SLEEP_CYCLES = 60_000_000  # torch.cuda._sleep: ~30 ms at the H200's ~2 GHz


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _runtime(ops=("moe_layer", "moe_layer_backward")) -> list:
    """[(op, impl, reason, calls)] of the MoE ops since the last kosmos.reset_report()."""
    import kosmos

    return sorted((op, impl, why, n) for (op, impl, why), n in kosmos.report().runtime.items() if op in ops)


def _group() -> str:
    return dist.group.WORLD.group_name


# ---------------------------------------------------------------------------------------------------- inputs


CASES = {
    # name: (dtype, T, H, I, E, top_k, routing, router arguments, KOSMOS_FUSED_MOE)
    "bf16_random": (torch.bfloat16, 333, 256, 128, 32, 4, "random", {}, "1"),
    "bf16_hot_experts": (torch.bfloat16, 301, 256, 128, 32, 4, "hot:0,1,2,-1", {}, "1"),
    "bf16_one_rank_hot": (torch.bfloat16, 257, 256, 128, 32, 4, "hot:0,1,2,3", {}, "1"),
    "fp32_random_router": (torch.float32, 200, 128, 64, 8, 2, "router", {}, "1"),
    "deepseek_bf16": (torch.bfloat16, 230, 256, 128, 32, 4, "random",
                      dict(scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           router_dtype=torch.float32, correction=True, return_router_logits=True), "1"),
    # the default env: fused forward, reference backward (the pairing through the empty saved_up)
    "bf16_default_env": (torch.bfloat16, 333, 256, 128, 32, 4, "random", {}, None),
}


def make_inputs(world: int, T, H: int, I: int, E: int, dtype, routing: str, correction: bool, seed: int = 0):
    """Every rank's inputs, the same on every rank (CPU generator): hidden [W] of [T_r, H] (T an int or a list per
    rank), router_weight [E, H], gate_up_proj [E, 2I, H], down_proj [E, H, I] (all experts), grad_out like hidden,
    grad_router_logits [T_r, E], score_correction_bias [E] fp32 or None; in dtype except the last."""
    g = torch.Generator().manual_seed(seed)
    ts = T if isinstance(T, list) else [T] * world
    hidden = [torch.randn(t, H, generator=g) for t in ts]
    if routing == "router":
        router_weight = torch.randn(E, H, generator=g) / H ** 0.5
    else:
        router_weight = torch.zeros(E, H)
        router_weight[torch.arange(E), torch.arange(E)] = 1.0
        values = ((torch.arange(E, dtype=torch.float32) - E // 2) * 0.125).sort(descending=True).values
        hot = [int(e) % E for e in routing.split(":")[1].split(",")] if routing.startswith("hot") else []
        cold = [e for e in range(E) if e not in hot]
        for h in hidden:
            if hot:  # the largest values on the hot experts, in a random order per token
                h[:, hot] = values[: len(hot)][torch.argsort(torch.rand(h.shape[0], len(hot), generator=g), -1)]
            h[:, cold] = values[len(hot):][torch.argsort(torch.rand(h.shape[0], len(cold), generator=g), -1)]
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    grad_out = [torch.randn(t, H, generator=g) for t in ts]
    grad_logits = [torch.randn(t, E, generator=g) for t in ts]
    corr = torch.randn(E, generator=g) * 0.05 if correction else None
    cast = lambda ts_: [t.to(dtype) for t in ts_]  # noqa: E731
    return (cast(hidden), router_weight.to(dtype), gate_up.to(dtype), down.to(dtype), cast(grad_out), grad_logits,
            corr)


def _router_kw(router: dict, top_k: int) -> dict:
    return dict(top_k=top_k, scoring=router.get("scoring", "softmax"), norm_topk_prob=True,
                n_group=router.get("n_group", 1), topk_group=router.get("topk_group", 1),
                routed_scaling_factor=router.get("routed_scaling_factor", 1.0),
                router_dtype=router.get("router_dtype"), return_router_logits=router.get("return_router_logits", False))


def layer_step(hidden, router_weight, corr, gate_up, down, grad_out, grad_logits, kw, ep=(None, 1), ep_mode=None,
               device="cuda", upcast=False):
    """kosmos::moe_layer forward and backward (autograd) of one rank -> (out, logits, counts, saved_up, [d_hidden,
    d_router_weight, d_gate_up_proj, d_down_proj]); upcast: every floating input in float32 first."""
    f = (lambda t: t.float()) if upcast else (lambda t: t)
    leaves = [f(t).to(device).requires_grad_() for t in (hidden, router_weight, gate_up, down)]
    extra = {} if ep_mode is None else {"ep_mode": ep_mode}
    out, logits, counts, saved, _ = torch.ops.kosmos.moe_layer(
        leaves[0], leaves[1], None, corr.to(device) if corr is not None else None, leaves[2], leaves[3], **kw,
        activation="silu", ep_group_name=ep[0], ep_world_size=ep[1], **extra)
    loss = (out * f(grad_out).to(device)).sum()
    if kw["return_router_logits"]:
        loss = loss + (logits * grad_logits.to(device, logits.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), logits.detach(), counts, saved, [g.detach() for g in grads]


def unsharded_reference(inputs, kw, device, ranks) -> list:
    """layer_step of each rank in `ranks` with every expert local, float32, the op's reference impl."""
    hidden, rw, gu, d, go, gl, corr = inputs
    with fused_env("0"):
        return [layer_step(hidden[r], rw, corr, gu, d, go[r], gl[r], kw, device=device, upcast=True) for r in ranks]


def compare(rank: int, world: int, got, refs, num_local: int) -> dict:
    """Relative errors of this rank's EP results against the unsharded references of every rank."""
    out, logits, counts, saved, grads = got
    mine = slice(rank * num_local, (rank + 1) * num_local)
    ref_out, ref_logits, _, _, ref_grads = refs[rank]
    e = {"out": rel(out, ref_out), "d_hidden": rel(grads[0], ref_grads[0]), "d_router_weight": rel(grads[1], ref_grads[1]),
         "d_gate_up_proj": rel(grads[2], sum(r[4][2] for r in refs)[mine]),
         "d_down_proj": rel(grads[3], sum(r[4][3] for r in refs)[mine])}
    if logits.shape[0]:
        e["logits"] = rel(logits, ref_logits)
    flags = {"counts_global": bool(torch.equal(counts.cpu(), sum(r[2].cpu() for r in refs))),
             "saved_up_empty": tuple(saved.shape) == (0, grads[2].shape[1]),
             "finite": all(bool(torch.isfinite(t).all()) for t in [out] + grads)}
    return {"errs": e, "flags": flags}


# ---------------------------------------------------------------------------------------------------- op suite


def _case(rank: int, world: int, name: str, device) -> dict:
    import kosmos

    dtype, T, H, I, E, k, routing, router, env = CASES[name]
    inputs = make_inputs(world, T, H, I, E, dtype, routing, router.get("correction", False),
                         seed=list(CASES).index(name))
    hidden, rw, gu, d, go, gl, corr = inputs
    num_local = E // world
    mine = slice(rank * num_local, (rank + 1) * num_local)
    kw = _router_kw(router, k)
    ep = (_group(), world)
    gu_l, d_l = gu[mine].contiguous(), d[mine].contiguous()
    kosmos.reset_report()
    with fused_env(env):
        got = layer_step(hidden[rank], rw, corr, gu_l, d_l, go[rank], gl[rank], kw, ep, device=device)
    res = {"runtime": _runtime()}
    refs = unsharded_reference(inputs, kw, device, range(world))
    res.update(compare(rank, world, got, refs, num_local))
    if routing.startswith("hot"):
        hot = {int(e) % E for e in routing.split(":")[1].split(",")}
        res["flags"]["experts_without_rows_zero_grads"] = all(
            bool(got[4][2][j].abs().max() == 0 and got[4][3][j].abs().max() == 0)
            for j in range(num_local) if rank * num_local + j not in hot)
        res["flags"]["routing_as_asked"] = int(got[2][sorted(hot)].sum()) == sum(len(h) for h in hidden) * k
    if name == "bf16_random":  # bit-identical reruns, a straggler rank, the launchers' hooks
        with fused_env(env):
            again = layer_step(hidden[rank], rw, corr, gu_l, d_l, go[rank], gl[rank], kw, ep, device=device)
            res["flags"]["rerun_bit_identical"] = _identical(got, again)
            with _straggling(rank == world - 1):
                late = layer_step(hidden[rank], rw, corr, gu_l, d_l, go[rank], gl[rank], kw, ep, device=device)
            res["flags"]["straggler_bit_identical"] = _identical(got, late)
        res.update(_launcher_hooks(rank, world, hidden[rank], rw, gu_l, d_l, go[rank], kw, device))
    return res


@contextlib.contextmanager
def _straggling(on: bool):
    """Delays this rank's stream before the block's work by torch.cuda._sleep. Through the op, the group check's
    all_reduce waits for the sleeping rank, so the kernels still start together; through the launchers they do not."""
    if on:
        torch.cuda._sleep(SLEEP_CYCLES)
    yield


def _identical(a, b) -> bool:
    flat = lambda r: [r[0], r[1], r[2]] + list(r[4])  # noqa: E731
    return all(torch.equal(x, y) for x, y in zip(flat(a), flat(b)))


def _launcher_hooks(rank, world, hidden, rw, gu_l, d_l, go, kw, device) -> dict:
    """The group launchers called directly (no group check before the launch): a straggler delayed by
    torch.cuda._sleep or inside the kernel, and other grid sizes, all bit-identical to a plain run."""
    from kosmos.kernels import runtime
    from kosmos.kernels.moe_ep_group import moe_ep_backward_group, moe_ep_forward_group

    h, w, g_u, dn, g = (t.to(device) for t in (hidden, rw, gu_l, d_l, go))
    router = (kw["top_k"], kw["scoring"], True, kw["n_group"], kw["topk_group"], kw["routed_scaling_factor"],
              kw["router_dtype"], "silu")

    def run(**hooks):
        fwd = moe_ep_forward_group(h, w, None, None, g_u, dn, *router, False, _group(), **hooks)
        bwd = moe_ep_backward_group(g, None, h, w, None, None, g_u, dn, *router, _group(), **hooks)
        return list(fwd) + list(bwd)

    base = run()
    full = runtime.default_programs(torch.device(device), 1)
    same = {}
    for name, hooks, sleep in (("sleep_last_rank", {}, rank == world - 1),
                               ("kernel_straggler_7_programs", dict(straggler=(world - 1, 2_000_000), programs=7), False),
                               ("kernel_straggler_half_grid", dict(straggler=(0, 1_000_000), programs=max(1, full // 2)),
                                False)):
        with _straggling(sleep):
            other = run(**hooks)
        same[f"launcher_{name}_bit_identical"] = all(torch.equal(a, b) for a, b in zip(base, other))
    torch.cuda.synchronize()
    runtime.group_workspace(_group(), torch.device(device)).check()
    return {"hooks": same}


def _fallbacks(rank: int, world: int, device) -> dict:
    """Calls the fused EP path refuses, each with its reason on every rank, the results still right."""
    import kosmos
    from kosmos.kernels import moe_ops

    res = {}
    H, I, E, k = 256, 128, 32, 4
    num_local = E // world
    mine = slice(rank * num_local, (rank + 1) * num_local)
    kw = _router_kw({}, k)
    ep = (_group(), world)
    for name, ts in (("token_counts_differ", [100 + 8 * r for r in range(world)]),
                     ("rank0_without_tokens", [0] + [50] * (world - 1))):
        inputs = make_inputs(world, ts, H, I, E, torch.bfloat16, "random", False, seed=11)
        hidden, rw, gu, d, go, gl, corr = inputs
        kosmos.reset_report()
        with fused_env("1"):
            got = layer_step(hidden[rank], rw, corr, gu[mine].contiguous(), d[mine].contiguous(), go[rank], gl[rank],
                             kw, ep, device=device)
        res[name] = {"runtime": _runtime(),
                     **compare(rank, world, got, unsharded_reference(inputs, kw, device, range(world)), num_local)}

    # ep_mode="all_reduce": every rank holds rank 0's tokens; the group sums the partial outputs
    inputs = make_inputs(world, 64, H, I, E, torch.bfloat16, "random", False, seed=12)
    hidden, rw, gu, d, go, gl, corr = inputs
    kosmos.reset_report()
    with fused_env("1"):
        got = layer_step(hidden[0], rw, corr, gu[mine].contiguous(), d[mine].contiguous(), go[0], gl[0], kw, ep,
                         ep_mode="all_reduce", device=device)
    runtime = _runtime()
    (ref,) = unsharded_reference(inputs, kw, device, [0])
    res["ep_mode_all_reduce"] = {"runtime": runtime, "errs": {"out": rel(got[0], ref[0]),
                                                              "d_hidden": rel(got[4][0], ref[4][0]),
                                                              "d_gate_up_proj": rel(got[4][2], ref[4][2][mine])}}

    # DeepSeek's fp32 router on bf16 hidden states under the default env with EP: reference forward (FP32_ROUTER_REASON)
    inputs = make_inputs(world, 64, H, I, E, torch.bfloat16, "random", True, seed=13)
    hidden, rw, gu, d, go, gl, corr = inputs
    ds = _router_kw(CASES["deepseek_bf16"][7], k)
    kosmos.reset_report()
    with fused_env(None):
        got = layer_step(hidden[rank], rw, corr, gu[mine].contiguous(), d[mine].contiguous(), go[rank], gl[rank], ds,
                         ep, device=device)
    res["fp32_router_default_env"] = {"runtime": _runtime(), "expected": moe_ops.FP32_ROUTER_REASON,
                                      **compare(rank, world, got, unsharded_reference(inputs, ds, device,
                                                                                      range(world)), num_local)}

    # groups the symmetric workspace cannot use, judged before any collective (the reason only; no call)
    gloo = dist.new_group(backend="gloo")
    h = hidden[rank].to(device)
    args = (h, rw.to(device), None, None, gu[mine].to(device), d[mine].to(device), k, "softmax", True)
    with fused_env("1"):
        res["gloo_group_reason"] = moe_ops.why_not_moe_layer(*args, ep_group_name=gloo.group_name,
                                                             ep_world_size=world)
        res["world_size_mismatch_reason"] = moe_ops.why_not_moe_layer(*args, ep_group_name=_group(),
                                                                      ep_world_size=2 * world)
    return res


def progress(rank: int, name: str, res: dict) -> None:
    """One line per finished case on stdout (run the tests with -s: a run cut short still shows what each rank saw)."""
    if "error" in res:  # the end of the traceback, on one line
        res = dict(res, error=res["error"][-700:].replace("\n", " | "))
    print(f"[rank {rank}] {name}: {json.dumps(res, default=str)[:1500]}", flush=True)


def op_suite(rank: int, world: int, cases: list) -> dict:
    """Every op case on this rank: {case: results, or {"error": traceback}}."""
    import traceback

    from kosmos.kernels import runtime

    importlib.import_module("kosmos")  # registers the ops and the fused impls

    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.set_spin_timeout(20.0)
    device = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for name in cases:
        t0 = time.monotonic()
        try:
            out[name] = _fallbacks(rank, world, device) if name == "fallbacks" else _case(rank, world, name, device)
        except Exception:  # noqa: BLE001  (recorded; the test shows it)
            out[name] = {"error": traceback.format_exc()[-4000:]}
        out[name]["seconds"] = time.monotonic() - t0
        progress(rank, name, out[name])
    return out


# ---------------------------------------------------------------------------------------------------- model


def model_suite(rank: int, world: int) -> dict:
    """A tiny HF Qwen3-MoE (fp32, tests/_dist.tiny_hf_model) under kosmos.parallelize(expert_parallel=True) on the
    NCCL group, compiled with backend="kosmos", against the unsharded eager model: loss and every gradient, under
    the default env (fused EP forward) and KOSMOS_FUSED_MOE=1 (fused EP backward too)."""
    import kosmos
    from _dist import SEQ, VOCAB, ep_grad_errors, tiny_hf_model
    from kosmos.kernels import runtime
    from torch.distributed.device_mesh import init_device_mesh

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runtime.set_spin_timeout(20.0)
    cuda = dist.get_backend() == "nccl"  # (gloo: a CPU dry run of this function, reference impls only)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = tiny_hf_model("qwen3_moe").to(device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    kosmos.parallelize(model, init_device_mesh(device.type, (world,)), expert_parallel=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kosmos")
    out = {"ep": model.model.layers[1].mlp.experts._kosmos_ep}
    for env in (None, "1"):
        model.zero_grad(set_to_none=True)
        kosmos.reset_report()
        with fused_env(env):
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        report = kosmos.report()
        out[str(env)] = {
            "loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_errors": ep_grad_errors(model, ref),
            "runtime": _runtime(),
            "moe_rewrites": [r.line() for r in report.records if r.kind == "moe_layer" and r.rewritten],
            "workspace_uses": {name: sorted(w["uses"]) for name, w in report.workspaces.items()},
        }
        progress(rank, f"model KOSMOS_FUSED_MOE={env}", {k: v for k, v in out[str(env)].items() if k != "grad_errors"}
                 | {"max_grad_error": max(out[str(env)]["grad_errors"].values())})
    return out


# ---------------------------------------------------------------------------------------------------- fault


def timeout_suite(rank: int, world: int) -> dict:
    """The last rank's SCAN task publishes no token counts (the launcher's drop_signal hook): every owner's
    OWNER_SCAN waits past a 1 s spin bound. Whether this rank raised KernelTimeout, its device error word, how long
    the call took, and what a later call on a workspace that raised does."""
    from kosmos.kernels import runtime
    from kosmos.kernels.moe import select_config
    from kosmos.kernels.moe_ep_group import moe_ep_forward_group

    importlib.import_module("kosmos")
    device = torch.device("cuda", torch.cuda.current_device())
    dtype, T, H, I, E, k, routing, router, _ = CASES["bf16_random"]
    T = 64
    hidden, rw, gu, d, _, _, _ = make_inputs(world, T, H, I, E, dtype, routing, False, seed=5)
    num_local = E // world
    h, w = hidden[rank].to(device), rw.to(device)
    gu_l = gu[rank * num_local:(rank + 1) * num_local].to(device)
    d_l = d[rank * num_local:(rank + 1) * num_local].to(device)
    group = _group()
    ws = runtime.group_workspace(group, device)
    runtime.set_spin_timeout(20.0)
    moe_ep_forward_group(h, w, None, None, gu_l, d_l, k, group_name=group)  # sets up and compiles: a clean call
    torch.cuda.synchronize()
    ws.check()
    n_tiles = math.ceil(T / select_config(h, gu_l, num_experts=E).bt)
    runtime.set_spin_timeout(1.0)
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    moe_ep_forward_group(h, w, None, None, gu_l, d_l, k, group_name=group, drop_signal=(world - 1, n_tiles))
    torch.cuda.synchronize()
    res = {"seconds": time.monotonic() - t0, "raised": None, "device_error": ws.read_device_error()[0]}
    try:
        ws.check()
    except runtime.KernelTimeout as e:
        res["raised"] = f"KernelTimeout: {e}"
    if res["raised"] is not None:  # a workspace that saw its timeout refuses the next call
        try:
            moe_ep_forward_group(h, w, None, None, gu_l, d_l, k, group_name=group)
            res["next_call"] = "ran"
        except runtime.WorkspaceBroken as e:
            res["next_call"] = f"WorkspaceBroken: {e}"
    runtime.set_spin_timeout(None)
    progress(rank, "missing signal", res)
    return res
