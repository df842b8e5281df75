"""The backend: reachable by name, settings through options=, FX graph cache hits, kill switch, user passes kept."""
from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import kosmos
from graph_capture import count_ops, fake_world

WORLD = 2


def ag_mm(x, w):
    g = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, WORLD, "0"))
    return (g @ w).relu()


def _installed() -> bool:
    """kosmos installed as a distribution (pip install -e . / wheel): what registers its entry point. The lent GPU
    machine runs it from source (nothing can be installed there): the two entry-point tests skip there."""
    try:
        importlib.metadata.distribution("kosmos")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_install = pytest.mark.skipif(not _installed(), reason="kosmos is not pip-installed here (run from source)")


@needs_install
def test_entry_point_registered():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "kosmos" and ep.value == "kosmos.backend:kosmos_backend" for ep in eps)


@needs_install
def test_backend_by_name_without_import():
    code = (
        "import sys, torch\n"
        "f = torch.compile(lambda x: x.sin() + 1, backend='kosmos')\n"
        "print(float(f(torch.ones(3)).sum()))\n"
        "print('kosmos' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split() == [f"{float((torch.ones(3).sin() + 1).sum())}", "True"]


def test_options_validated():
    with pytest.raises(Exception, match="unknown kosmos options"):
        torch._dynamo.reset()
        torch.compile(lambda x: x + 1, backend="kosmos", options={"no_such_option": 1})(torch.ones(2))


def test_inductor_modes_reach_inductor(monkeypatch):
    """mode= as with Inductor: its settings go to Inductor's compile as config patches, beside kosmos's post-grad
    pass; an unknown mode is an error naming the known ones."""
    import torch._inductor.compile_fx as compile_fx_module

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    out = torch.compile(lambda x: (x @ x.t()).relu(), backend="kosmos", mode="max-autotune-no-cudagraphs")(x)
    torch.testing.assert_close(out, (x @ x.t()).relu())
    assert seen and seen[0]["max_autotune"] is True and seen[0]["coordinate_descent_tuning"] is True
    assert "post_grad_custom_post_pass" in seen[0]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Unrecognized mode=fastest"):
        torch.compile(lambda x: x + 1, backend="kosmos", mode="fastest")(x)
    torch._dynamo.reset()


def _compile_once(options=None):
    torch._dynamo.reset()
    kosmos.reset_report()
    f = torch.compile(ag_mm, backend="kosmos", options=options)
    return f(torch.randn(4, 8), torch.randn(8, 3))


def test_second_compile_hits_fx_graph_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._inductor.utils import fresh_cache

    with fake_world(WORLD), fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True, fx_graph_remote_cache=False):
        counters.clear()
        _compile_once()
        assert kosmos.report().count(kind="ag_gemm") == 1
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
        _compile_once()
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
        # a different option changes the pass uuid: a miss, not a stale hit
        _compile_once(options={"move_cast_before_gather": False})
        assert counters["inductor"]["fxgraph_cache_miss"] == 2


def test_pass_uuid_follows_the_ops_sources(tmp_path, monkeypatch):
    """The ops' schemas and registered autograd shape the backward graph that a cache entry holds: a kosmos whose
    ops changed must miss the cache (a stale entry called moe_layer_backward with arguments it no longer takes)."""
    import shutil

    from kosmos import backend

    package = pathlib.Path(backend.__file__).parent
    copy = tmp_path / "kosmos"
    for part in ("passes", "ops"):
        shutil.copytree(package / part, copy / part)
    shutil.copy(package / "options.py", copy / "options.py")
    monkeypatch.setattr(backend, "_PACKAGE", copy)

    def uuid():
        backend._pass_sources_hash.cache_clear()
        return backend._pass_sources_hash()

    try:
        before = uuid()
        assert uuid() == before
        with open(copy / "ops" / "moe.py", "a") as f:
            f.write("\n# changed\n")
        assert uuid() != before
    finally:
        backend._pass_sources_hash.cache_clear()


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.saw_kosmos_op = None

    def __call__(self, graph):
        self.saw_kosmos_op = any("kosmos.ag_gemm" in str(n.target) for n in graph.nodes)

    def uuid(self):
        return "user-pass-v1"


def test_user_post_grad_pass_still_runs_after_kosmos():
    user = _UserPass()
    with fake_world(WORLD), torch._inductor.config.patch(post_grad_custom_post_pass=user, fx_graph_cache=False):
        _compile_once()
    assert user.saw_kosmos_op is True


def test_kill_switch_gives_plain_inductor(monkeypatch):
    monkeypatch.setenv("KOSMOS_DISABLE", "1")
    from graph_capture import compile_and_capture

    with fake_world(WORLD):
        graphs = compile_and_capture(ag_mm, torch.randn(4, 8), torch.randn(8, 3), backward=False)
    code = graphs["inference"][0].code
    assert count_ops(code, "ag_gemm") == 0
    assert "all_gather_into_tensor" in code
    assert kosmos.report().records == []


def test_explain_reports_rewrites_and_impl():
    with fake_world(WORLD):
        rep = kosmos.explain(ag_mm, torch.randn(4, 8), torch.randn(8, 3))
    [rec] = rep.rewrites
    assert (rec.kind, rec.graph, rec.impl) == ("ag_gemm", "inference", "reference")
    assert "cpu tensors" in rec.impl_reason
    assert "ag_gemm: rewritten" in str(rep)
    assert rep.runtime[("ag_gemm", "reference", rec.impl_reason)] == 1


def test_report_lists_graph_breaks_since_reset():
    """Code Dynamo cuts out of the graph runs eagerly and no kosmos pass sees it: the report names each break
    counted since reset_report(), with Dynamo's hint, and forgets the ones from before."""

    def broken(x):
        x = x.sin()
        torch._dynamo.graph_break()
        return x.cos()

    torch._dynamo.reset()
    torch.compile(broken, backend="kosmos")(torch.randn(4))
    kosmos.reset_report()
    assert kosmos.report().graph_breaks == {}
    torch._dynamo.reset()
    torch.compile(broken, backend="kosmos")(torch.randn(4))
    rep = kosmos.report()
    [(msg, n)] = rep.graph_breaks.items()
    assert n == 1 and "graph_break" in msg, rep.graph_breaks
    assert "graph breaks Dynamo counted" in str(rep) and "\n    x1: " in str(rep), str(rep)


def test_fused_kernel_that_does_not_fit_takes_reference_with_reason():
    """A fused impl whose kernel build turns out not to fit the GPU (raised by the launcher before any launch)
    sends the call to the reference impl, and the report says why."""
    from kosmos.kernels.runtime import KernelDoesNotFit
    from kosmos.ops import dispatch

    def run(x):
        raise KernelDoesNotFit("big_kernel does not fit this GPU: out of resource: shared memory")

    dispatch.register_fused("_test_op", lambda x: None, run)
    try:
        kosmos.reset_report()
        assert dispatch.try_fused("_test_op", torch.device("cuda"), 1) == (False, None)
        runs = kosmos.report().runtime
        assert runs == {("_test_op", "reference", "big_kernel does not fit this GPU: out of resource: shared memory"):
                        1}, runs
        dispatch.register_fused("_test_op", lambda x: None, lambda x: x + 1)
        assert dispatch.try_fused("_test_op", torch.device("cuda"), 1) == (True, 2)
        assert ("_test_op", "fused", "supported") in kosmos.report().runtime
    finally:
        dispatch._fused.pop("_test_op", None)


class _LanguageModelHead(torch.nn.Module):
    def __init__(self, vocab=300, dim=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.frozen = torch.nn.Embedding(7, dim).requires_grad_(False)
        self.last_padded = torch.nn.Embedding(5, dim, padding_idx=-1)  # row 4
        self.unpadded = torch.nn.Embedding(5, dim)  # every row trains, the last too
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids) + self.frozen(ids % 7) + self.last_padded(ids % 5) + self.unpadded(ids % 5)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("aten", [True, False])
def test_embedding_backward_as_atens_kernel(aten):
    """By default a trained embedding becomes kosmos::embedding, whose backward is aten's kernel (no fp32 [V, H]
    buffer of Inductor's decomposition), reported as such; a frozen one is left alone with its reason; the option
    gives Inductor's decomposition back. Gradients match eager either way."""
    model = _LanguageModelHead()
    ids = torch.randint(0, 300, (3, 20))
    ids[0, :4] = 0  # padding_idx rows get no gradient
    model(ids).backward()
    ref = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    graphs = []

    class Spy(CustomGraphPass):
        def __call__(self, graph):
            graphs.append([str(n.target) for n in graph.nodes if n.op == "call_function"])

        def uuid(self):
            return None

    torch._dynamo.reset()
    kosmos.reset_report()
    with torch._inductor.config.patch(post_grad_custom_post_pass=Spy(), fx_graph_cache=False):
        f = torch.compile(model, backend="kosmos", options={"aten_embedding_backward": aten})
        f(ids).backward()
    for p, r in zip([p for p in model.parameters() if p.requires_grad], ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)
    forward, backward = graphs
    assert ("kosmos.embedding.default" in forward) == aten
    assert ("kosmos.embedding_backward.default" in backward) == aten
    assert any("index_put" in t for t in backward) != aten  # the decomposition's fp32 accumulate
    recs = [r for r in kosmos.report().records if r.kind == "embedding"]
    if aten:
        done, alone = [r for r in recs if r.rewritten], [r for r in recs if not r.rewritten]
        assert len(done) == 3 and done[0].shapes == {"num_weights": 300, "dim": 16}
        assert "no 300 x 16 fp32 buffer" in done[0].line()
        assert len(alone) == 1 and "needs no gradient" in alone[0].reason
    else:
        assert recs == []
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embedding_backward_cuda_bf16_and_cuda_graphs():
    """On CUDA in bf16 (aten's sort-based kernel): gradients as eager's (the same kernel, so equal up to the rest of
    the compiled step's rounding), and under Inductor's CUDA graph trees every graph is recorded (the kernel does
    not sync with the host) and the replays give the non-graphed step's gradients (to the rounding of Inductor's own
    kernels, which may differ between the two compiles)."""
    torch.manual_seed(0)
    model = _LanguageModelHead(vocab=5000, dim=256).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 5000, (4, 512), device="cuda")
    ids[0, :8] = 0

    def grads(f):
        model.zero_grad(set_to_none=True)
        f(ids).backward()
        return [p.grad.float().clone() for p in model.parameters() if p.requires_grad]

    eager = grads(model)
    torch._dynamo.reset()
    kosmos.reset_report()
    compiled = grads(torch.compile(model, backend="kosmos"))
    assert kosmos.report().count("embedding", "pre-grad") == 3, str(kosmos.report())
    for g, r in zip(compiled, eager):
        assert ((g - r).norm() / r.norm()).item() < 2e-2
    assert compiled[0][0].abs().max().item() == 0  # padding row
    torch._dynamo.reset()
    counters.clear()
    graphed = torch.compile(model, backend="kosmos", mode="reduce-overhead")
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        replayed = grads(graphed)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for g, r in zip(replayed, compiled):
        assert ((g - r).norm() / r.norm()).item() < 1e-3
    torch._dynamo.reset()
