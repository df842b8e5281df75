"""TP+SP sharding of unmodified Hugging Face decoder LMs, the input kosmos' TP+SP passes are built for.

    model = kosmos.parallelize(hf_model, mesh)              # this module
    model = torch.compile(model, backend="kosmos")          # the passes fuse the collectives below
    loss = model(input_ids=ids, labels=labels).loss         # same loss on every rank; backward on every rank

Supported: `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`, `DeepseekV3ForCausalLM` (transformers >= 5.17), on a
1-D `DeviceMesh` over the TP group, fp32 or bf16. `parallelize` shards the model in place with
`torch.distributed.tensor.parallel.parallelize_module` and returns it. The weights of rank 0 are the
model's weights (sharded parameters are scattered and replicated ones broadcast from it).

Layout (T = TP size, S = sequence length; "layout" below is Shard(1) with sequence_parallel=True, the
default, and Replicate() without):

* residual stream: a DTensor of global shape [B, S, H] in `layout` from the embedding to the final
  norm. HF's model-level code (position ids, causal mask, rotary tables) reads the embedding output's
  shape, so it sees the global sequence length and stays correct.
* embed_tokens: vocab-sharded (Shard(0)); its partial output is reduce-scattered to `layout`.
* input/post-attention/final norms: weights Replicate DTensors, run on the sequence shard.
* every DTensor parameter's gradient is laid out like the parameter (a hook redistributes what DTensor
  hands back: the norms' Partial grads are all-reduced, the embedding's Replicate grad is sliced).
* attention and dense MLP ("TP regions"): the input is all-gathered along the sequence (Shard(1) ->
  Replicate) at the module input and becomes a plain local tensor whose gradient is *partial*
  (this rank's share); in backward that gradient is reduce-scattered back to Shard(1) — one
  reduce-scatter per region, after the sum of the column-parallel input-grad matmuls.
  Column-parallel (weight Shard(0), local output columns): q/k/v_proj, gate/up_proj; DeepSeek MLA:
  q_b_proj (or q_proj) and kv_b_proj. Row-parallel (weight Shard(1)): o_proj, down_proj; their
  partial output is reduce-scattered to `layout` (backward: all-gather). Heads are split evenly, so
  num_attention_heads (and Qwen3's num_key_value_heads) must divide by T; HF views with -1 heads.
* replicated parameters inside a TP region (Qwen3 q_norm/k_norm, which act on the local heads;
  DeepSeek q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm, which feed local heads) see
  only this rank's share of their gradient: a tensor hook sums their gradient over the TP group
  (HF's "replicated_with_grad_allreduce"), before accumulation, so gradient accumulation is exact.
* MoE blocks (Qwen3-MoE sparse block, DeepSeek-V3 MoE with its shared experts): not sharded. Their
  input stays sequence-sharded; each rank routes its own tokens with full replicated weights, and the
  weights' gradients are summed over the TP group by the same hook. (Without sequence parallelism each
  rank takes its sequence chunk of the replicated input and the output is all-gathered.) An
  auxiliary router loss (output_router_logits=True) would see only the local tokens.
* expert parallelism (`expert_parallel=True`; the EP group is the same 1-D mesh, as usual inside a
  node): each MoE block's routed experts are split over the group. `experts.gate_up_proj` [E, 2I, H]
  and `experts.down_proj` [E, H, I] become plain local nn.Parameters holding this rank's contiguous
  slice of experts [r * E/T, (r + 1) * E/T) (E must divide by T); the router (weight, DeepSeek's
  e_score_correction_bias) and the shared experts stay replicated as above. The experts module runs
  `kosmos::moe_experts` with the EP group (each rank routes its own tokens; the routed rows go to the
  experts' owners by all-to-all and come back), so the eager model is correct too; under
  `torch.compile(backend="kosmos")` the MoE pass turns router + that call into one EP
  `kosmos::moe_layer`. Expert weight gradients are the local experts' full gradients (no hook).
  `experts._kosmos_ep = (group_name, ep_world_size, first_local_expert)` (also set on the two
  parameters) records the split. `model.state_dict()` holds the local experts (load_state_dict of
  it on the same layout round-trips); `full_state_dict(model)` gathers the full one.
* lm_head: column-parallel (vocab-sharded weight) on the all-gathered final hidden states, logits
  all-gathered to Replicate: every rank holds the full [B, S, V] logits as a plain tensor, so HF's
  own loss (`labels=`) or `F.cross_entropy` in the caller both work and give the same loss on every
  rank. Call backward on every rank. Tied embeddings stay tied (both vocab-sharded).

Use plain (non-DTensor) inputs; the sequence length must divide by T when sequence_parallel=True.
`model._kosmos_tp` (a `TPPlan`) records what was done.

Optimizers: build them on `param_groups(model)` (one group of DTensor parameters, one of the plain
replicated ones), e.g. `torch.optim.AdamW(param_groups(model), lr=...)`. A foreach or fused optimizer
(the default on CUDA) cannot take DTensors and plain tensors in one group ("got mixed torch.Tensor
and DTensor").
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

__all__ = ["parallelize", "param_groups", "TPPlan", "SUPPORTED_MODELS", "full_tensor", "full_state_dict"]

# class name -> family
SUPPORTED_MODELS = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclasses.dataclass
class TPPlan:
    """What `parallelize` did to a model (kept as `model._kosmos_tp`)."""

    family: str
    mesh: DeviceMesh
    sequence_parallel: bool
    styles: dict[str, str]  # module FQN -> style
    grad_allreduce: list[str]  # parameter FQNs whose gradient is summed over the TP group by a hook
    expert_parallel: bool = False
    expert_sharded: list[str] = dataclasses.field(default_factory=list)  # parameter FQNs split by expert (EP)

    @property
    def world_size(self) -> int:
        return self.mesh.size()


# ---------------------------------------------------------------------------------------------
# Gradient all-reduce for replicated parameters that see partial gradients


def _sum_grad_over_group(group_name: str, grad: torch.Tensor) -> torch.Tensor:
    fc = torch.ops._c10d_functional
    return fc.wait_tensor(fc.all_reduce(grad.contiguous(), "sum", group_name))


def _grad_like_param(placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    """DTensor may hand back a parameter's gradient in another layout than the parameter's: a Replicate
    norm weight's as Partial (summed over the sequence shards), the vocab-sharded embedding's as
    Replicate. Redistribute it here, once, so optimizers and clipping see gradients laid out like their
    parameters (Partial -> Replicate is an all-reduce, Replicate -> Shard a local slice)."""
    if isinstance(grad, DTensor) and grad.placements != placements:
        grad = grad.redistribute(placements=placements)
    return grad


def _broadcast_from_mesh_rank0(t: torch.Tensor, mesh: DeviceMesh) -> None:
    group = mesh.get_group()
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)


# ---------------------------------------------------------------------------------------------
# Parallel styles


class _ResidualNorm(ParallelStyle):
    """A norm on the residual stream: weights Replicate DTensors, input and output DTensors in `layout`."""

    def __init__(self, layout):
        super().__init__()
        self.layout = (layout,)

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            dp = nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()]), requires_grad=p.requires_grad)
            module.register_parameter(name, dp)
        layout = self.layout

        def to_layout(mod, args):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, layout, run_check=False)
            elif x.placements != layout:
                x = x.redistribute(placements=layout)
            return (x,) + tuple(args[1:])

        module.register_forward_pre_hook(to_layout)
        return module

    def __repr__(self):
        return f"ResidualNorm({self.layout[0]})"


def _enter_region(x: torch.Tensor, mesh: DeviceMesh, layout: tuple) -> torch.Tensor:
    """Residual-stream DTensor in `layout` -> the full tensor as a plain local tensor whose gradient is
    this rank's partial share. Forward: all-gather along the sequence (Shard(1)) or nothing
    (Replicate). Backward: reduce-scatter to Shard(1), or all-reduce to Replicate."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, layout, run_check=False)
    if x.placements != (Replicate(),):
        x = x.redistribute(placements=[Replicate()])
    else:
        # Megatron's "f": identity forward, all-reduce backward (from_local of a Replicate input
        # all-reduces a Partial gradient), so the residual stream only ever carries Replicate grads
        x = DTensor.from_local(x.to_local(grad_placements=[Replicate()]), mesh, [Replicate()], run_check=False)
    return x.to_local(grad_placements=[Partial()])


class _EnterTPRegion(ParallelStyle):
    """Module input `arg` (the residual stream in `layout`) -> the full sequence as a local tensor
    (see `_enter_region`); `arg` is a keyword argument (HF passes hidden_states=) or else the first
    positional one."""

    def __init__(self, layout, arg: str = "hidden_states"):
        super().__init__()
        self.layout = (layout,)
        self.arg = arg

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        layout, arg = self.layout, self.arg

        def hook(mod, args, kwargs):
            if arg in kwargs:
                kwargs = dict(kwargs)
                kwargs[arg] = _enter_region(kwargs[arg], mesh, layout)
            elif args:
                args = (_enter_region(args[0], mesh, layout),) + tuple(args[1:])
            else:
                raise TypeError(f"kosmos.parallelize: {type(mod).__name__} was called without its input {arg!r}")
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self):
        return f"EnterTPRegion({self.layout[0]} -> Replicate local, partial grad; arg={self.arg!r})"


class _LocalShardLinear(nn.Linear):
    """nn.Linear whose weight (and bias) are DTensors sharded on dim 0; computes on the local shards.

    Used for the column-parallel linears inside a TP region: the input is the region's local full
    tensor, the output this rank's columns, and the input gradient stays local (partial)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to_local() if self.bias is not None else None
        return nn.functional.linear(x, self.weight.to_local(), bias)


class _ColwiseInRegion(ParallelStyle):
    """Column-parallel nn.Linear inside a TP region (local input, local output columns)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear:
            raise TypeError(f"kosmos.parallelize: column-parallel layer must be an nn.Linear, "
                            f"got {type(module).__name__}")
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]), requires_grad=p.requires_grad)
            )
        module.__class__ = _LocalShardLinear
        return module

    def __repr__(self):
        return "ColwiseInRegion(weight Shard(0))"


class _GatheredLogitsLinear(nn.Linear):
    """lm_head: vocab-sharded weight (Shard(0)) applied to the local full sequence, logits all-gathered
    over the vocab to a plain full tensor whose gradient is the full (replicated) gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to_local() if self.bias is not None else None
        local = nn.functional.linear(x, self.weight.to_local(), bias)
        mesh = self.weight.device_mesh
        out = DTensor.from_local(local, mesh, [Shard(local.dim() - 1)], run_check=False)
        return out.redistribute(placements=[Replicate()]).to_local(grad_placements=[Replicate()])


class _VocabParallelHead(ParallelStyle):
    """lm_head: gather the hidden states (as a TP region entry), vocab-sharded matmul, gather the logits."""

    def __init__(self, layout):
        super().__init__()
        self.enter = _EnterTPRegion(layout, "input")

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        _ColwiseInRegion()._apply(module, mesh)
        module.__class__ = _GatheredLogitsLinear
        return self.enter._apply(module, mesh)

    def __repr__(self):
        return f"VocabParallelHead({self.enter.layout[0]} -> Replicate hidden, weight Shard(0), logits Replicate)"


class _ReplicatedGradAllReduce(ParallelStyle):
    """Replicated parameters that see only this rank's share of their gradient: sum it over the group."""

    def __init__(self, grad_allreduce: list, prefix: str):
        super().__init__()
        self.sink = grad_allreduce
        self.prefix = prefix

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        group_name = mesh.get_group().group_name
        for name, p in module.named_parameters():
            if getattr(p, "_kosmos_ep", None) is not None:
                continue  # expert-sharded (EP): local experts, local gradients
            if isinstance(p, DTensor):
                raise TypeError(f"kosmos.parallelize: {self.prefix}.{name} is already a DTensor")
            with torch.no_grad():
                _broadcast_from_mesh_rank0(p.data, mesh)
            if p.requires_grad:
                p.register_hook(functools.partial(_sum_grad_over_group, group_name))
                p._kosmos_grad_allreduce = group_name
                self.sink.append(f"{self.prefix}.{name}" if self.prefix else name)
        return module

    def __repr__(self):
        return "ReplicatedGradAllReduce"


_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def _ep_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF experts forward of an expert-sharded experts module: kosmos::moe_experts over the EP group."""
    from kosmos.ops import moe as _moe_ops  # noqa: F401  (registers torch.ops.kosmos.moe_experts)

    group_name, ep_world_size, _ = self._kosmos_ep
    gate_up, down = self.gate_up_proj, self.down_proj
    if getattr(self, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
        gate_up, down = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    out, _ = torch.ops.kosmos.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, "silu",
                                          group_name, ep_world_size)
    return out


@functools.lru_cache(maxsize=None)
def _ep_experts_class(cls: type) -> type:
    return type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _ep_experts_forward, "__module__": __name__})


def _shard_experts(experts: nn.Module, mesh: DeviceMesh, prefix: str, sink: list) -> None:
    """Keeps this rank's contiguous slice of the routed experts (rank 0's weights, broadcast first)."""
    from kosmos.hf_experts import unsupported_reason

    reason = unsupported_reason(experts) if hasattr(experts, "has_gate") else "not a transformers v5 experts module"
    if reason is not None or not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in _EXPERT_WEIGHTS):
        raise ValueError(f"kosmos.parallelize(expert_parallel=True): {prefix} ({type(experts).__name__}) cannot be "
                         f"expert-sharded: {reason or 'no gate_up_proj / down_proj parameters'}")
    ep = mesh.size()
    num_experts = experts.gate_up_proj.shape[0]
    if num_experts % ep != 0:
        raise ValueError(f"kosmos.parallelize(expert_parallel=True): {prefix} has {num_experts} experts, which must "
                         f"divide by the EP size {ep}")
    num_local = num_experts // ep
    rank = mesh.get_local_rank()
    ep_info = (mesh.get_group().group_name, ep, rank * num_local)
    for name in _EXPERT_WEIGHTS:
        p = getattr(experts, name)
        with torch.no_grad():
            full = p.data.contiguous()
            _broadcast_from_mesh_rank0(full, mesh)
            local = nn.Parameter(full[rank * num_local : (rank + 1) * num_local].clone(), requires_grad=p.requires_grad)
        local._kosmos_ep = ep_info
        experts.register_parameter(name, local)
        sink.append(f"{prefix}.{name}")
    experts._kosmos_ep = ep_info
    experts.__class__ = _ep_experts_class(type(experts))


class _LocalTokens(ParallelStyle):
    """An unsharded module (MoE block) run on this rank's sequence shard as a plain local tensor; its
    replicated parameters see only this rank's tokens, so their gradients are summed over the group.
    With `expert_sharded` (a list to record into), the routed experts are split over the group (EP)."""

    def __init__(self, layout, grad_allreduce: list, prefix: str, expert_sharded: Optional[list] = None):
        super().__init__()
        self.layout = (layout,)
        self.params = _ReplicatedGradAllReduce(grad_allreduce, prefix)
        self.prefix = prefix
        self.expert_sharded = expert_sharded

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.expert_sharded is not None:
            _shard_experts(module.experts, mesh, f"{self.prefix}.experts", self.expert_sharded)
        self.params._apply(module, mesh)
        layout = self.layout
        shard = (Shard(1),)

        def to_local(mod, args, kwargs):
            x = args[0] if args else kwargs.pop("hidden_states")
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, layout, run_check=False)
            if x.placements != shard:
                x = x.redistribute(placements=shard)
            # the output's global shape/stride (chunks may be uneven without sequence parallelism)
            mod._kosmos_global_shape = (x.shape, x.stride())
            return (x.to_local(grad_placements=shard),) + tuple(args[1:]), kwargs

        def from_local(mod, args, kwargs, out):
            rest = ()
            if isinstance(out, tuple):  # e.g. (hidden_states, router_logits)
                out, rest = out[0], out[1:]
            shape, stride = mod._kosmos_global_shape
            out = DTensor.from_local(out, mesh, shard, run_check=False, shape=shape, stride=stride)
            if shard != layout:
                out = out.redistribute(placements=layout)
            return (out,) + rest if rest else out

        module.register_forward_pre_hook(to_local, with_kwargs=True)
        module.register_forward_hook(from_local, with_kwargs=True)
        return module

    def __repr__(self):
        ep = ", experts split over the group (EP)" if self.expert_sharded is not None else ""
        return f"LocalTokens({self.layout[0]} -> Shard(1) local{ep})"


class _CheckSequenceLength(ParallelStyle):
    """On the embedding: the sequence length must divide by the TP size (sequence sharding)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        tp = mesh.size()

        def check(mod, args):
            ids = args[0]
            if ids.dim() < 2 or ids.shape[1] % tp != 0:
                raise ValueError(
                    f"kosmos.parallelize: sequence length {tuple(ids.shape)[1:2]} of input_ids {tuple(ids.shape)} "
                    f"must divide by the TP size {tp} (sequence parallelism shards the sequence); pad the batch"
                )

        module.register_forward_pre_hook(check)
        return module


# ---------------------------------------------------------------------------------------------
# Plans


def _family(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__name__ in SUPPORTED_MODELS:
            return SUPPORTED_MODELS[cls.__name__]
    raise TypeError(
        f"kosmos.parallelize does not support {type(model).__name__}; supported: {sorted(SUPPORTED_MODELS)} "
        "(the *ForCausalLM classes of transformers >= 5.17)"
    )


def _check_divisible(what: str, value: Optional[int], tp: int) -> None:
    if value is not None and value % tp != 0:
        raise ValueError(f"kosmos.parallelize: {what} = {value} must be divisible by the TP size {tp}")


def _is_moe_block(mlp: nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def _check_config(family: str, model: nn.Module, tp: int) -> None:
    cfg = model.config
    _check_divisible("num_attention_heads", cfg.num_attention_heads, tp)
    if family in ("qwen3", "qwen3_moe"):
        _check_divisible("num_key_value_heads", cfg.num_key_value_heads, tp)
    _check_divisible("vocab_size", cfg.vocab_size, tp)
    for layer in model.model.layers:
        if not _is_moe_block(layer.mlp):
            _check_divisible("intermediate_size of the dense MLP", layer.mlp.gate_proj.out_features, tp)


def _build_plan(family: str, model: nn.Module, layout, grad_allreduce: list,
                expert_sharded: Optional[list] = None) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    colwise = _ColwiseInRegion
    rowwise = functools.partial(RowwiseParallel, output_layouts=layout, use_local_output=False)

    def replicated(fqn: str) -> ParallelStyle:
        return _ReplicatedGradAllReduce(grad_allreduce, fqn)

    plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=layout,
                                                 use_local_output=False)
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        plan[f"{p}.input_layernorm"] = _ResidualNorm(layout)
        plan[f"{p}.post_attention_layernorm"] = _ResidualNorm(layout)
        attn = layer.self_attn
        plan[f"{p}.self_attn"] = _EnterTPRegion(layout, "hidden_states")
        if family in ("qwen3", "qwen3_moe"):
            for name in ("q_proj", "k_proj", "v_proj"):
                plan[f"{p}.self_attn.{name}"] = colwise()
            for name in ("q_norm", "k_norm"):
                plan[f"{p}.self_attn.{name}"] = replicated(f"{p}.self_attn.{name}")
        else:  # deepseek_v3: multi-head latent attention
            if getattr(attn, "q_proj", None) is not None:
                plan[f"{p}.self_attn.q_proj"] = colwise()
            else:
                plan[f"{p}.self_attn.q_a_proj"] = replicated(f"{p}.self_attn.q_a_proj")
                plan[f"{p}.self_attn.q_a_layernorm"] = replicated(f"{p}.self_attn.q_a_layernorm")
                plan[f"{p}.self_attn.q_b_proj"] = colwise()
            plan[f"{p}.self_attn.kv_a_proj_with_mqa"] = replicated(f"{p}.self_attn.kv_a_proj_with_mqa")
            plan[f"{p}.self_attn.kv_a_layernorm"] = replicated(f"{p}.self_attn.kv_a_layernorm")
            plan[f"{p}.self_attn.kv_b_proj"] = colwise()
        plan[f"{p}.self_attn.o_proj"] = rowwise()
        if _is_moe_block(layer.mlp):
            plan[f"{p}.mlp"] = _LocalTokens(layout, grad_allreduce, f"{p}.mlp", expert_sharded)
        else:
            plan[f"{p}.mlp"] = _EnterTPRegion(layout, "x")
            plan[f"{p}.mlp.gate_proj"] = colwise()
            plan[f"{p}.mlp.up_proj"] = colwise()
            plan[f"{p}.mlp.down_proj"] = rowwise()
    plan["model.norm"] = _ResidualNorm(layout)
    plan["lm_head"] = _VocabParallelHead(layout)
    return plan


def _check_plan_covers_every_parameter(model: nn.Module, plan: dict[str, ParallelStyle]) -> None:
    """Every parameter must be sharded, replicated as a DTensor, or summed over the group by a hook: a
    parameter no style owns (a module a newer transformers added?) would silently get wrong grads."""
    owned = set()
    for fqn, style in plan.items():
        if isinstance(style, _EnterTPRegion):
            continue  # owns no parameters: its submodules have their own styles
        owned |= {f"{fqn}.{n}" for n, _ in model.get_submodule(fqn).named_parameters(remove_duplicate=False)}
    unknown = [n for n, p in model.named_parameters() if n not in owned and p.requires_grad]
    if unknown:
        raise NotImplementedError(
            f"kosmos.parallelize: no TP rule for parameter(s) {unknown} of {type(model).__name__} "
            "(a transformers version kosmos does not know?)"
        )


def parallelize(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = True,
                expert_parallel: bool = False) -> nn.Module:
    """Shards `model` (an unmodified HF Qwen3 / Qwen3-MoE / DeepSeek-V3 *ForCausalLM) over the 1-D
    TP `mesh` in place and returns it; see the module docstring for the layout. `expert_parallel=True`
    also splits the routed experts of every MoE block over the same group (EP)."""
    family = _family(model)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"kosmos.parallelize: mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"kosmos.parallelize: mesh must be 1-D (the TP group), got a {mesh.ndim}-D mesh; "
                         "pass mesh['tp']")
    if getattr(model, "_kosmos_tp", None) is not None:
        raise ValueError("kosmos.parallelize: this model is already parallelized")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("kosmos.parallelize: the model already has DTensor parameters (sharded by something else)")
    tp = mesh.size()
    _check_config(family, model, tp)
    if expert_parallel:
        for i, layer in enumerate(model.model.layers):
            if _is_moe_block(layer.mlp):
                _check_divisible(f"the number of routed experts of model.layers.{i}.mlp (expert parallelism)",
                                 layer.mlp.experts.gate_up_proj.shape[0], tp)

    tied = model.lm_head.weight is model.model.embed_tokens.weight
    layout = Shard(1) if sequence_parallel else Replicate()
    grad_allreduce: list[str] = []
    expert_sharded: Optional[list[str]] = [] if expert_parallel else None
    plan = _build_plan(family, model, layout, grad_allreduce, expert_sharded)
    _check_plan_covers_every_parameter(model, plan)

    parallelize_module(model, mesh, plan)
    if sequence_parallel:
        _CheckSequenceLength()._apply(model.model.embed_tokens, mesh)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # both Shard(0) over the vocab

    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(functools.partial(_grad_like_param, p.placements))

    styles = {k: repr(v) for k, v in plan.items()}
    if sequence_parallel:
        styles["model.embed_tokens"] += " + CheckSequenceLength"
    model._kosmos_tp = TPPlan(family, mesh, sequence_parallel, styles, grad_allreduce, expert_parallel,
                              expert_sharded or [])
    return model


def param_groups(model: nn.Module, **options) -> list[dict]:
    """Optimizer parameter groups of a parallelized model: its DTensor parameters, then its plain ones
    (each group gets `options`, e.g. weight_decay). Foreach/fused optimizers need them apart."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g, **options} for g in groups if g]


def full_tensor(t: Any) -> Any:
    """The full (unsharded) value of a DTensor (Partial reduced, shards gathered), else `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> Optional[dict]:
    """The unsharded state_dict of a parallelized model (collective: call it on every rank): DTensors
    gathered to full tensors, expert-sharded (EP) parameters all-gathered along the expert dim. Returns
    it on rank 0 of the mesh (on every rank with rank0_only=False), else None. Its keys and shapes are
    the unsharded model's, so `unsharded.load_state_dict(full_state_dict(model))` works."""
    plan = getattr(model, "_kosmos_tp", None)
    if plan is None:
        raise ValueError("kosmos.full_state_dict: the model was not parallelized by kosmos.parallelize")
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in model.state_dict().items():
        ep = getattr(params.get(key), "_kosmos_ep", None)
        if ep is not None:
            group = plan.mesh.get_group()
            parts = [torch.empty_like(value) for _ in range(ep[1])]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        else:
            value = full_tensor(value)
        out[key] = value.detach().clone()
    if rank0_only and plan.mesh.get_local_rank() != 0:
        return None
    return out
