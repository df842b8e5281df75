"""kosmos: a torch.compile backend that overlaps communication with computation in persistent Triton kernels.

    model = torch.compile(model, backend="kosmos")

`import kosmos` registers the backend (pip install registers it through an entry point as well).
"""
from kosmos import ops  # noqa: F401  (registers torch.ops.kosmos.*)
from kosmos.kernels import fused_ops as _fused_ops  # noqa: F401  (registers the fused CUDA impls)
from kosmos.backend import kosmos_backend, register as _register
from kosmos.hf_experts import register as register_hf_experts
from kosmos.reporting import Report, report, reset as reset_report

_register()
register_hf_experts()  # experts_implementation="kosmos" for HF MoE models (a no-op without transformers)

__all__ = ["kosmos_backend", "report", "reset_report", "Report", "explain", "parallelize"]


def explain(fn, *args, **kwargs) -> Report:
    """Compiles `fn` with the kosmos backend (no FX graph cache, so every pass runs), runs it once on
    the arguments, and returns what kosmos rewrote and left alone in the forward graph (and the
    backward graph, if the output needs grad and `backward=True`)."""
    return _explain(fn, *args, **kwargs)


def _explain(fn, *args, backward: bool = False, options=None, **kwargs):
    import torch

    torch._dynamo.reset()
    reset_report()
    compiled = torch.compile(fn, backend="kosmos", options=options)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = compiled(*args, **kwargs)
        if backward:
            loss = out if isinstance(out, torch.Tensor) else out[0]
            loss.float().sum().backward()
    return report()


def parallelize(model, mesh, **kwargs):
    """Applies kosmos' TP+SP (+EP) plan to an unmodified HF model; see kosmos.parallel."""
    from kosmos.parallel import parallelize as _parallelize

    return _parallelize(model, mesh, **kwargs)
