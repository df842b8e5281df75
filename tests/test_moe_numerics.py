"""Numerics of the MoE ops and of models compiled with kosmos (single process, CPU, reference impls):
the ops against HF's experts and torch autograd, and tiny HF models compiled with backend="kosmos" against
eager (loss, aux loss and every parameter's gradient)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kosmos  # noqa: E402
import kosmos.hf_experts  # noqa: E402,F401  (registers experts_implementation="kosmos")
from kosmos.ops import moe as moe_ops  # noqa: E402
from kosmos.ops import moe_math  # noqa: E402
from test_moe_pass import CASES, IDS, MODELS, _loss_and_grads, compile_run, count, model_run, token_ids, tiny_qwen3_moe  # noqa: E402

FP32_TOL = 1e-5
BF16_TOL = 3e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    denom = ref.norm().item()
    return (out - ref).norm().item() / denom if denom > 0 else (out - ref).norm().item()


def assert_close_grads(grads: dict, ref: dict, tol: float) -> None:
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    errs = {name: rel_err(grads[name], ref[name]) for name in ref}
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"grads over {tol}: {bad}"


# ------------------------------------------------------------------------------------------- ops


def _inputs(dtype=torch.float32, T=24, H=32, E=8, I=16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    return rnd(T, H), rnd(E, H), rnd(E, 2 * I, H, scale=0.2), rnd(E, H, I, scale=0.2)


ROUTERS = {  # scoring, norm_topk_prob, n_group, topk_group, routed_scaling_factor, router_dtype, correction, bias
    "qwen3": ("softmax", True, 1, 1, 1.0, None, False, False),
    "mixtral_no_renorm": ("softmax", False, 1, 1, 1.0, None, False, True),
    "deepseek_v3": ("sigmoid", True, 4, 2, 2.5, torch.float32, True, False),
    "sigmoid_plain": ("sigmoid", False, 1, 1, 1.0, None, False, True),
}


def _layer_args(h, w, gu, d, router, top_k=3, return_logits=True):
    scoring, norm, n_group, topk_group, scale, rd, correction, bias = ROUTERS[router]
    e = w.shape[0]
    rb = (torch.linspace(-0.1, 0.1, e, dtype=w.dtype)).requires_grad_() if bias else None
    sb = torch.linspace(-0.05, 0.05, e) if correction else None
    return (h, w, rb, sb, gu, d, top_k, scoring, norm, n_group, topk_group, scale, rd, "silu", return_logits, None, 1)


def test_experts_match_hf_grouped_mm_experts():
    from transformers.integrations.moe import grouped_mm_experts_forward

    experts = tiny_qwen3_moe(num_hidden_layers=1).model.layers[0].mlp.experts
    h = torch.randn(40, 64)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(40)])
    w = torch.rand(40, 2)
    with torch.no_grad():
        ref = grouped_mm_experts_forward(experts, h, ids, w)
        out, counts = torch.ops.kosmos.moe_experts(h, ids, w, experts.gate_up_proj, experts.down_proj)
    assert rel_err(out, ref) <= 1e-6
    assert counts.dtype == torch.int32 and counts.tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()


def test_router_matches_hf_routers():
    qwen = tiny_qwen3_moe(num_hidden_layers=1).model.layers[0].mlp.gate
    from test_moe_pass import tiny_deepseek_v3

    ds = tiny_deepseek_v3().model.layers[1].mlp.gate
    h = torch.randn(32, 64)
    with torch.no_grad():
        for gate, args in ((qwen, (None, None, 2, "softmax", True, 1, 1, 1.0, None)),
                           (ds, (None, ds.e_score_correction_bias, 2, "sigmoid", True, 2, 1, 2.5, torch.float32))):
            ref_logits, ref_w, ref_ids = gate(h)
            logits, ids, w = moe_ops.route(h, gate.weight, *args)
            assert torch.equal(logits, ref_logits) and torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_backward_op_matches_autograd_of_reference(router):
    h, w, gu, d = _inputs()
    args = _layer_args(h, w, gu, d, router)
    out, logits = torch.ops.kosmos.moe_layer(*args)[:2]
    go, gl = torch.randn_like(out), torch.randn_like(logits)
    leaves = [t for t in (h, w, args[2], gu, d) if t is not None]
    got = torch.autograd.grad((out * go).sum() + (logits * gl).sum(), leaves)
    # the same math through torch autograd
    ref_logits, ids, weights = moe_ops.route(h, w, *args[2:4], *args[6:13])
    ref_out, _ = moe_ops.experts(h, ids, weights, gu, d)
    assert torch.equal(ref_out, out) and torch.equal(ref_logits, logits)
    ref = torch.autograd.grad((ref_out * go).sum() + (ref_logits * gl).sum(), leaves)
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= FP32_TOL


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3"])
def test_no_tokens_forward_and_backward(router):
    """T = 0 (a rank of a data-parallel group left without tokens): saved_up holds only the E pad rows and topk_ids is
    [0, k]; the backward takes that empty routing as the forward's (not as "routing not saved") and gives zero
    gradients of the weights."""
    h, w, gu, d = _inputs()
    h = h.detach()[:0].requires_grad_()
    args = _layer_args(h, w, gu, d, router)
    out, logits, counts, saved_up, topk_ids = torch.ops.kosmos.moe_layer(*args)
    assert tuple(out.shape) == (0, 32) and tuple(topk_ids.shape) == (0, 3) and saved_up.shape[0] == w.shape[0]
    assert counts.tolist() == [0] * w.shape[0]
    leaves = [t for t in (h, w, args[2], gu, d) if t is not None]
    grads = torch.autograd.grad(out.sum() + logits.sum(), leaves)
    assert tuple(grads[0].shape) == (0, 32)
    assert all(float(g.abs().sum()) == 0 for g in grads[1:])


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_backward_follows_the_forwards_routing(router):
    """moe_layer_backward gathers the scores at the forward's topk_ids (moe_layer's last output) instead of selecting
    again: a forward whose routing differs from the reference's (the fused kernel at a near-tie of the logits) gets
    the gradient of ITS routing, and saved_up's rows (the up projection of its pairs) line up with the pairs."""
    h, w, gu, d = _inputs()
    args = _layer_args(h, w, gu, d, router)
    rb, sb, k = args[2], args[3], args[6]
    router_args = args[6:13]
    _, ids, _ = moe_ops.route(h, w, rb, sb, *router_args)
    other = ids.clone()  # token 0's last choice moved to an expert it did not pick (what a near-tie flip does)
    other[0, -1] = next(e for e in range(w.shape[0]) if e not in ids[0].tolist())
    go = torch.randn(h.shape)
    leaves = [t for t in (h, w, rb, gu, d) if t is not None]
    # the gradient of `other`'s forward, by torch autograd
    _, _, weights, _ = moe_ops._route_forward(h, w, rb, sb, *router_args, ids=other)
    ref = torch.autograd.grad((moe_ops.experts(h, other, weights, gu, d)[0] * go).sum(), leaves)

    def backward(routing):
        with torch.no_grad():
            _, _, wts, _ = moe_ops._route_forward(h, w, rb, sb, *router_args, ids=routing)
            saved_up = moe_ops.experts(h.detach(), routing, wts, gu.detach(), d.detach(), return_up=True)[2]
        plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
        grads = torch.ops.kosmos.moe_layer_backward(go, None, *plain[:14], None, 1, "all_to_all", None, None,
                                                    saved_up, routing.to(torch.int32))
        return [g for g in (grads[0], grads[1], grads[4] if rb is not None else None, grads[2], grads[3])
                if g is not None]

    for name, a, b in zip(("hidden", "router_weight", "router_bias", "gate_up", "down"), backward(other), ref):
        assert rel_err(a, b) <= FP32_TOL, name
    # the backward does use what it is given: its own selection's saved_up and routing give other gradients
    assert max(rel_err(a, b) for a, b in zip(backward(ids), ref)) > 1e-3
    with pytest.raises(ValueError, match="saved_up without topk_ids"):
        plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
        torch.ops.kosmos.moe_layer_backward(go, None, *plain[:14], None, 1, "all_to_all", None, None,
                                            torch.zeros(h.shape[0] * k + w.shape[0], gu.shape[1]), None)


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3"])
def test_opcheck_moe_layer(router):
    """Not test_aot_dispatch_dynamic: it returns saved_up from the traced function, and a graph whose user keeps
    saved_up cannot let the backward overwrite it (AOT autograd's partitioner refuses: saved_up belongs to the
    backward). Compiled forward + backward of the op: tests/test_moe_saved_activations.py and the models here."""
    h, w, gu, d = _inputs(T=8, H=16, E=8, I=8)
    torch.library.opcheck(torch.ops.kosmos.moe_layer.default, _layer_args(h, w, gu, d, router, top_k=2),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_opcheck_moe_experts():
    h, _, gu, d = _inputs(T=8, H=16, E=8, I=8)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(8)])
    weights = torch.rand(8, 2, requires_grad=True)
    torch.library.opcheck(torch.ops.kosmos.moe_experts.default, (h, ids, weights, gu, d))


# ------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("name,dtype,router_logits", CASES, ids=IDS)
def test_compiled_model_matches_eager(name, dtype, router_logits):
    run = model_run(name, dtype, router_logits)
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    assert rel_err(run.loss, run.eager_loss) <= tol, (run.loss, run.eager_loss)
    assert_close_grads(run.grads, run.eager_grads, tol)
    if router_logits:  # the aux loss reads the router logits the op returns
        eager_aux, aux = run.aux_loss
        assert eager_aux is not None and rel_err(aux, eager_aux) <= tol
        assert any("router logits" in r.reason for r in run.report.rewrites)


def test_kosmos_experts_implementation_matches_eager():
    model = tiny_qwen3_moe()
    ids = token_ids()
    eager_loss, eager_grads, _ = _loss_and_grads(model, ids)  # HF's grouped_mm experts
    model.set_experts_implementation("kosmos")
    run = compile_run(model, ids)
    assert rel_err(run.loss, eager_loss) <= FP32_TOL
    assert_close_grads(run.grads, eager_grads, FP32_TOL)
    layers = MODELS["qwen3_moe"][1]
    assert count(run.forward, "moe_experts") == layers and count(run.backward, "moe_experts_backward") == layers
    # nothing for the MoE pass to do, nothing to complain about (the embedding has its own rewrite)
    assert [r for r in run.report.records if r.kind != "embedding"] == [], str(run.report)


@pytest.mark.gpu
@pytest.mark.parametrize("name,dtype", [("qwen3_moe", "bfloat16"), ("deepseek_v3", "bfloat16"), ("qwen3_moe", "float32")])
def test_compiled_model_matches_eager_cuda(name, dtype):
    """On CUDA the grouped GEMM is torch._grouped_mm (bf16) and histc runs on int ids; the op runs its reference
    impl until the fused kernels are registered."""
    build, layers = MODELS[name]
    model = build(getattr(torch, dtype)).cuda()
    run = compile_run(model, token_ids().cuda())
    tol = FP32_TOL if dtype == "float32" else BF16_TOL
    assert run.report.count("moe_layer", "pre-grad") == layers, str(run.report)
    assert count(run.forward, "moe_layer") == layers and count(run.backward, "moe_layer_backward") == layers
    assert rel_err(run.loss, run.eager_loss) <= tol
    assert_close_grads(run.grads, run.eager_grads, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_reference_forward_on_kosmos_grouped_gemm_matches_eager_cuda(name, monkeypatch):
    """The default forward for experts on kosmos's grouped GEMM (Qwen3-235B and DeepSeek-V3 sizes; made to apply to
    the tiny models by lowering moe_ops' size and expert-count thresholds): the reference forward, its grouped
    matmuls on kosmos's kernel; the report says so and why, and the compiled bf16 model's loss and gradients match
    eager."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("kosmos's grouped GEMM runs on sm_90")
    import kosmos.kernels.fused_ops  # noqa: F401  (registers the fused impls and row kernels)
    from kosmos.kernels import moe_ops as kernel_ops

    monkeypatch.delenv("KOSMOS_FUSED_MOE", raising=False)
    monkeypatch.delenv("KOSMOS_GROUPED_MM", raising=False)
    monkeypatch.setattr(kernel_ops, "WIDE_EXPERT", 0)
    monkeypatch.setattr(kernel_ops, "CLAIMED_EXPERT", 0)
    monkeypatch.setattr(kernel_ops, "REFERENCE_MIN_EXPERTS", 0)
    build, layers = MODELS[name]
    run = compile_run(build(torch.bfloat16).cuda(), token_ids().cuda())
    forward = {(impl, why) for (op, impl, why) in run.report.runtime if op == "moe_layer"}
    assert len(forward) == 1, forward
    ((impl, why),) = forward
    assert impl == "reference" and why.startswith("the reference forward: its expert matmuls"), forward
    assert any(op == "grouped_mm" and impl.startswith("kosmos grouped_ws") for (op, impl, _) in run.report.runtime)
    routers = {impl for (op, impl, _) in run.report.runtime if op == "router_logits"}
    # DeepSeek-V3's fp32 router on bf16 hidden states runs kosmos's router kernel; Qwen3's bf16 router is torch's
    assert routers == ({"kosmos router_gemm"} if name == "deepseek_v3" else set()), run.report.runtime
    assert count(run.forward, "moe_layer") == layers and count(run.backward, "moe_layer_backward") == layers
    assert rel_err(run.loss, run.eager_loss) <= BF16_TOL
    assert_close_grads(run.grads, run.eager_grads, BF16_TOL)


def _varying_lengths(device: str, dtype: torch.dtype, tol: float) -> None:
    """Training steps at three sequence lengths through one torch.compile: Dynamo recompiles the second with a
    symbolic token count (automatic dynamic shapes); the MoE blocks of that graph are rewritten too, and every step
    matches eager."""
    model = tiny_qwen3_moe(dtype).to(device)
    torch._dynamo.reset()
    kosmos.reset_report()
    compiled = torch.compile(model, backend="kosmos", options={"tp_sp": False})
    for seq in (8, 12, 20):
        ids = token_ids(seq=seq).to(device)
        eager_loss, eager_grads, _ = _loss_and_grads(model, ids)
        loss, grads, _ = _loss_and_grads(compiled, ids)
        assert rel_err(loss, eager_loss) <= tol, (seq, loss, eager_loss)
        assert_close_grads(grads, eager_grads, tol)
    rewrites = [r for r in kosmos.report().rewrites if r.kind == "moe_layer"]
    layers = MODELS["qwen3_moe"][1]
    assert len(rewrites) == 2 * layers, str(kosmos.report())  # the static graph's and the dynamic graph's
    assert any(str(r.shapes.get("T", "")).startswith("2*s") for r in rewrites), str(kosmos.report())  # 2 * symbolic seq


def test_varying_sequence_lengths_match_eager():
    _varying_lengths("cpu", torch.float32, FP32_TOL)


@pytest.mark.gpu
def test_varying_sequence_lengths_match_eager_cuda():
    _varying_lengths("cuda", torch.bfloat16, BF16_TOL)


def test_compiled_autograd_matches_eager():
    """torch._dynamo.config.compiled_autograd with the backward inside the compiled training step: the backward is
    traced again at .backward(), through the AOT backward graph that holds kosmos::moe_layer_backward; the op still
    runs and the gradients match eager."""
    model = tiny_qwen3_moe()
    ids = token_ids()
    eager_loss, eager_grads, _ = _loss_and_grads(model, ids)
    torch._dynamo.reset()
    kosmos.reset_report()
    with torch._dynamo.config.patch(compiled_autograd=True):
        step = torch.compile(_loss_and_grads, backend="kosmos", options={"tp_sp": False})
        loss, grads, _ = step(model, ids)
    captures = torch._dynamo.utils.counters["compiled_autograd"]["captures"]  # (torch._dynamo.reset clears it)
    torch._dynamo.reset()
    assert captures >= 1, "the backward did not go through compiled autograd"
    assert rel_err(loss, eager_loss) <= FP32_TOL
    assert_close_grads(grads, eager_grads, FP32_TOL)
    report = kosmos.report()
    layers = MODELS["qwen3_moe"][1]
    assert report.count("moe_layer", "pre-grad") == layers, str(report)
    runs = {op: n for (op, _, _), n in report.runtime.items()}
    assert runs.get("moe_layer") == layers and runs.get("moe_layer_backward") == layers, str(report)


_HUB_KERNEL_SIDE_EFFECT = "Attempted to mutate UserDefinedObjectVariable(CompileableContextVar)"


def _compiled_loss_and_grads(model, ids):
    torch._dynamo.reset()
    kosmos.reset_report()
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cache hit skips the post-grad passes' records
        loss, grads, _ = _loss_and_grads(torch.compile(model, backend="kosmos", options={"tp_sp": False}), ids)
    report = kosmos.report()
    print(report)  # which impls ran (shown with -rA)
    return loss, grads, report


def _enable_checkpointing(model, reentrant: bool, every_n_layers: int) -> int:
    """HF's activation checkpointing on `model` (transformers >= 5.25: activation_checkpointing_enable, which can
    checkpoint every n-th decoder layer only; before it gradient_checkpointing_enable, every layer); returns how many
    MoE blocks sit in checkpointed layers."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant},
                                              every_n_layers=every_n_layers)
    elif every_n_layers == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        pytest.skip("every_n_layers needs transformers >= 5.25")
    return sum(bool(layer.gradient_checkpointing) and hasattr(layer.mlp, "experts") for layer in model.model.layers)


def _checkpointed(name: str, device: str, dtype: torch.dtype, tol: float, reentrant: bool,
                  every_n_layers: int = 1) -> None:
    """HF's activation checkpointing (torch.utils.checkpoint around each decoder layer, or every n-th one): Dynamo
    traces each checkpointed layer into a higher-order op's body graph; the MoE blocks there are rewritten too (they
    were silently not: the report said "0 rewritten, 0 left alone"), the forward skips the saved up rows and the
    backward recomputes the op; the other layers' blocks save them as without checkpointing. Where transformers'
    hub-kernel wrappers make Dynamo run the layers eagerly, the report must say so and torch's documented flag must
    make them compile."""
    build, layers = MODELS[name]
    model = build(dtype).to(device)
    recomputed = _enable_checkpointing(model, reentrant, every_n_layers)
    assert recomputed == layers or every_n_layers > 1, recomputed
    model.train()
    ids = token_ids().to(device)
    eager_loss, eager_grads, _ = _loss_and_grads(model, ids)
    loss, grads, report = _compiled_loss_and_grads(model, ids)
    if _HUB_KERNEL_SIDE_EFFECT in str(report):
        # transformers >= 5.25 with its `kernels` dependency wraps Qwen3 attention's forward in code that sets a
        # global: Dynamo cannot trace that inside a checkpoint, so every checkpointed layer ran eagerly (under
        # Inductor too), the others compiled. The report must say so, with torch's way around it, which then has to
        # work.
        assert report.count("moe_layer", "pre-grad") == layers - recomputed, str(report)
        assert "skip_fwd_side_effects_in_bwd_under_checkpoint = True" in str(report), str(report)
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            loss, grads, report = _compiled_loss_and_grads(model, ids)
        assert _HUB_KERNEL_SIDE_EFFECT not in str(report), str(report)
    assert report.count("moe_layer", "pre-grad") == layers, str(report)
    assert rel_err(loss, eager_loss) <= tol, (loss, eager_loss)
    assert_close_grads(grads, eager_grads, tol)
    calls = {op: sum(n for (o, _, _), n in report.runtime.items() if o == op)
             for op in ("moe_layer", "moe_layer_backward")}
    # a checkpointed layer's backward recomputes the op
    assert calls == {"moe_layer": layers + recomputed, "moe_layer_backward": layers}, calls
    if not reentrant:  # a backward graph that recomputes the op overwrites the saved up rows it made (no copy)
        inplace = [r.reason for r in report.records if r.kind == "saved_up_in_place"]
        made = [r for r in inplace if "made in this graph" in r]
        assert len(inplace) == layers and len(made) == recomputed, inplace


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_rewritten_and_matches_eager(name, reentrant):
    _checkpointed(name, "cpu", torch.float32, FP32_TOL, reentrant)


def test_checkpointing_every_second_layer_rewritten_and_matches_eager():
    """transformers >= 5.25's every_n_layers=2: checkpointed and plain layers in one model (Qwen3-MoE's two MoE
    layers: the first checkpointed and recomputed, the second not; DeepSeek-V3's proxy has one, not checkpointed)."""
    _checkpointed("qwen3_moe", "cpu", torch.float32, FP32_TOL, False, every_n_layers=2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_checkpointing_rewritten_and_matches_eager_cuda(name):
    _checkpointed(name, "cuda", torch.bfloat16, BF16_TOL, False)


def _autocast_block(name: str, device: str, tol: float) -> None:
    """An fp32 MoE block run under torch.autocast(bfloat16), as mixed-precision training runs it (HF Trainer's
    bf16=True): autocast computes the router's linear in bf16 (DeepSeek-V3's explicit fp32 casts included); the
    rewritten block must do the same (router_dtype bf16), so its output and gradients match eager's to fp32
    rounding, not to a different routing's bf16-level differences. (DeepSeek-V3's bf16 sigmoid scores tie often, 2^-8
    apart near 0.5, and top-k implementations break ties differently: a looser bound there. With an fp32 router in
    the op the errors were 1.9e-3 (Qwen3) and 9.3e-2 (DeepSeek-V3); Inductor alone on this block: 1.9e-3 and
    9.3e-2 as well.)"""
    layer = {"qwen3_moe": 0, "deepseek_v3": 1}[name]  # an MoE layer (DeepSeek-V3's first is dense)
    block = MODELS[name][0]().to(device).model.layers[layer].mlp
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 64, block.experts.gate_up_proj.shape[-1], generator=g).to(device)
    go = torch.randn(x.shape, generator=g).to(device)

    def run(fn):
        block.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn(xi)
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * go).sum().backward()
        return out.detach().float(), xi.grad, {n: p.grad for n, p in block.named_parameters() if p.grad is not None}

    want = run(block)
    torch._dynamo.reset()
    kosmos.reset_report()
    got = run(torch.compile(block, backend="kosmos", options={"tp_sp": False}))
    rewrites = [r for r in kosmos.report().rewrites if r.kind == "moe_layer"]
    assert len(rewrites) == 1, str(kosmos.report())
    assert rel_err(got[0], want[0]) <= tol and rel_err(got[1], want[1]) <= tol, (rel_err(got[0], want[0]),
                                                                                 rel_err(got[1], want[1]))
    assert_close_grads(got[2], want[2], tol)


@pytest.mark.parametrize("name,tol", [("qwen3_moe", 1e-5), ("deepseek_v3", 1e-2)])
def test_autocast_block_matches_eager(name, tol):
    _autocast_block(name, "cpu", tol)


@pytest.mark.gpu
@pytest.mark.parametrize("name,tol", [("qwen3_moe", 1e-4), ("deepseek_v3", 1e-2)])
def test_autocast_block_matches_eager_cuda(name, tol):
    _autocast_block(name, "cuda", tol)


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3"])
def test_backward_reads_the_forwards_logits(router):
    """Without EP moe_layer returns its router logits even when the model does not ask for them, and its autograd
    hands them to moe_layer_backward, which takes the scores from them instead of running the router GEMM again (on
    the CPU that GEMM gives the same bits: the gradients equal those of a backward without them)."""
    h, w, gu, d = _inputs()
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in _layer_args(h, w, gu, d, router,
                                                                                 return_logits=False)]
    out, logits, _, saved_up, topk_ids = torch.ops.kosmos.moe_layer(*plain)
    assert tuple(logits.shape) == (h.shape[0], w.shape[0])
    go = torch.randn(h.shape)

    def backward(router_logits):
        return torch.ops.kosmos.moe_layer_backward(go, None, *plain[:14], None, 1, "all_to_all", None, None,
                                                   saved_up.clone(), topk_ids, router_logits)

    given, recomputed = backward(logits), backward(None)
    assert all(torch.equal(a, b) for a, b in zip(given, recomputed))
    moved = backward(logits + 0.5 * torch.randn(logits.shape))  # the backward does read them
    assert rel_err(moved[0], given[0]) > 1e-3 and rel_err(moved[1], given[1]) > 1e-3
    with pytest.raises(ValueError, match="router_logits"):
        backward(logits[:, :-1])


# ------------------------------------------------------------------------------------------- frozen parameters


def _count_calls(monkeypatch, module, name: str) -> list:
    """Patches module.name to record each call's arguments (then runs the original)."""
    calls, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("router", ["qwen3", "deepseek_v3", "mixtral_no_renorm"])
def test_backward_skips_gradients_not_needed(router, monkeypatch):
    """grads_needed (autograd's needs_input_grad): a gradient not needed comes back empty, its matmuls are not run
    (the experts' weight gradients are two of the backward's five grouped matmuls), and the others are the same bits
    as with every gradient."""
    h, w, gu, d = _inputs()
    plain = [t.detach() if isinstance(t, torch.Tensor) else t for t in _layer_args(h, w, gu, d, router)]
    out, logits, _, saved_up, topk_ids = torch.ops.kosmos.moe_layer(*plain)
    go, gl = torch.randn(out.shape), torch.randn(logits.shape)
    wgrads = _count_calls(monkeypatch, moe_math, "_grouped_wgrad")
    router_grads = _count_calls(monkeypatch, moe_ops, "_router_param_grads")

    def backward(needed):
        return torch.ops.kosmos.moe_layer_backward(go, gl, *plain[:14], None, 1, "all_to_all", None, needed,
                                                   saved_up.clone(), topk_ids, logits)

    full = backward(None)
    has_bias = plain[2] is not None
    assert len(wgrads) == 2 and len(router_grads) == 1 and (full[4].numel() > 0) == has_bias
    for needed in ([True, True, False, False, True], [True, False, True, True, False], [False, True, True, False, True],
                   [False, False, False, False, False]):
        wgrads.clear()
        router_grads.clear()
        got = backward(needed)
        for name, a, b, need in zip(("hidden", "router_weight", "gate_up", "down", "router_bias"), got, full, needed):
            if need:
                assert torch.equal(a, b), (name, needed)
            else:
                assert a.numel() == 0, (name, needed)
        assert len(wgrads) == needed[2] + needed[3], needed
        assert len(router_grads) == (needed[1] or (needed[4] and has_bias)), needed
    with pytest.raises(ValueError, match="grads_needed has 3 flags, want 5"):
        backward([True, True, True])


FROZEN = {"experts": ("mlp.experts.",), "router": ("mlp.gate.",), "moe_block": ("mlp.",)}
# (grads_needed of moe_layer_backward, weight-gradient grouped matmuls and router weight gradients per layer)
FROZEN_EXPECT = {"experts": ([True, True, False, False, True], 0, 1), "router": ([True, False, True, True, True], 2, 0),
                 "moe_block": ([True, False, False, False, True], 0, 0)}


def _frozen(name: str, frozen: str, device: str, dtype: torch.dtype, tol: float, monkeypatch) -> None:
    """Fine-tuning with some weights frozen (requires_grad False): the compiled model matches eager, the backward
    graph asks moe_layer_backward for the trained inputs' gradients only, and the frozen weights' matmuls do not
    run (Inductor skips them for HF's own graph too)."""
    build, layers = MODELS[name]
    model = build(dtype).to(device)
    for n, p in model.named_parameters():
        if n.startswith("model.layers.") and any(part in n for part in FROZEN[frozen]):
            p.requires_grad_(False)
    wgrads = _count_calls(monkeypatch, moe_math, "_grouped_wgrad")
    router_grads = _count_calls(monkeypatch, moe_ops, "_router_param_grads")
    with torch._inductor.config.patch(fx_graph_cache=False):
        run = compile_run(model, token_ids().to(device))
    assert rel_err(run.loss, run.eager_loss) <= tol, (run.loss, run.eager_loss)
    assert_close_grads(run.grads, run.eager_grads, tol)
    needed, n_wgrads, n_router = FROZEN_EXPECT[frozen]
    flags = [n.args[20] for g in run.backward for n in (g.graph if hasattr(g, "graph") else g).nodes
             if n.op == "call_function" and str(n.target) == "kosmos.moe_layer_backward.default"]
    assert flags == [needed] * layers, flags
    assert len(wgrads) == n_wgrads * layers and len(router_grads) == n_router * layers, (len(wgrads), len(router_grads))


@pytest.mark.parametrize("name,frozen", [("qwen3_moe", "experts"), ("qwen3_moe", "router"),
                                         ("deepseek_v3", "moe_block")])  # (moe_block: DeepSeek-V3's experts too)
def test_frozen_parameters_match_eager_and_skip_their_matmuls(name, frozen, monkeypatch):
    _frozen(name, frozen, "cpu", torch.float32, FP32_TOL, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(MODELS))
def test_frozen_experts_match_eager_and_skip_their_matmuls_cuda(name, monkeypatch):
    _frozen(name, "experts", "cuda", torch.bfloat16, BF16_TOL, monkeypatch)


def test_kosmos_experts_implementation_with_frozen_experts(monkeypatch):
    """The `kosmos` experts implementation (moe_experts) skips the frozen experts' weight gradients too."""
    model = tiny_qwen3_moe()
    model.set_experts_implementation("kosmos")
    for n, p in model.named_parameters():
        if ".experts." in n:
            p.requires_grad_(False)
    ids = token_ids()
    eager_loss, eager_grads, _ = _loss_and_grads(model, ids)
    wgrads = _count_calls(monkeypatch, moe_math, "_grouped_wgrad")
    with torch._inductor.config.patch(fx_graph_cache=False):
        run = compile_run(model, ids)
    assert rel_err(run.loss, eager_loss) <= FP32_TOL
    assert_close_grads(run.grads, eager_grads, FP32_TOL)
    assert count(run.backward, "moe_experts_backward") == MODELS["qwen3_moe"][1] and wgrads == []
