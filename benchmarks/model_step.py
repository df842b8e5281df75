"""Whole-model training step: unmodified HF Qwen3-MoE and DeepSeek-V3 decoder models (the real models' layer dims and
vocabulary, a few layers, random weights) eager, under Inductor and under backend="kosmos": median step time,
tokens/s, peak memory, the loss and gradients against eager's, and what kosmos rewrote and ran (its report).

    PYTHONPATH=.:benchmarks python3 benchmarks/model_step.py --models qwen3_30b_a3b --layers 4 --batch 2 --seq 4096
    PYTHONPATH=.:benchmarks python3 benchmarks/model_step.py --tiny          # CPU smoke run of the script (no timing)

A step is model(input_ids, labels=input_ids).loss, its backward into every parameter, and the gradients dropped
(set to None): no optimizer, whose step costs the same under every compiler. --mode reduce-overhead compiles both
with Inductor's CUDA graph trees (no peak memory then: replays allocate nothing). Truncating the model to a few layers
keeps the embedding and the LM head whole, so they weigh more in the step than in the full model (Qwen3-30B-A3B:
48 layers); the MoE layer's own figures are benchmarks/moe.py's. DeepSeek-V3 keeps its first dense layer
(first_k_dense_replace = 1) ahead of its MoE layers. Every variant trains the same model on the same tokens; errors are
the first step's loss and the global gradient norm against eager's (bf16: a few 1e-3 are the compiled-vs-eager drift).
"""
from __future__ import annotations

import argparse
import json

import torch

from measure import bench_calls
from peak_trace import live_at_peak

MODELS = {
    "qwen3_30b_a3b": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936),
    "qwen3_235b": dict(family="qwen3_moe", hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                       num_experts=128, num_experts_per_tok=8, num_attention_heads=64, num_key_value_heads=4,
                       head_dim=128, vocab_size=151936),
    "deepseek_v3": dict(family="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
                        routed_scaling_factor=2.5, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        first_k_dense_replace=1, vocab_size=129280),
}
TINY = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        vocab_size=256),
}


def build_model(name: str, layers: int, device, dtype, tiny: bool = False):
    import transformers as T

    d = dict(MODELS[name])
    family = d.pop("family")
    if tiny:
        d.update(TINY[family])
    cfg_cls, model_cls = ((T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM) if family == "qwen3_moe"
                          else (T.DeepseekV3Config, T.DeepseekV3ForCausalLM))
    extra = dict(norm_topk_prob=True) if family == "qwen3_moe" else {}
    cfg = cfg_cls(num_hidden_layers=layers, max_position_embeddings=32768, tie_word_embeddings=False, **extra, **d)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg).to(dtype)
    with torch.no_grad():  # HF init leaves some weights at zero (biases, correction bias): never time on zeros
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
            elif (p == 0).all():
                p.copy_(torch.randn_like(p) * 0.01)
    return model.train(), cfg


def grad_norm(model) -> float:
    return torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])).item()


def run_model(name: str, args) -> dict:
    import kosmos

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    model, cfg = build_model(name, args.layers, device, dtype, args.tiny)
    batch, seq = (2, 32) if args.tiny else (args.batch, args.seq)
    gen = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device, generator=gen)
    n_params = sum(p.numel() for p in model.parameters())
    res = {"model": name, "layers": args.layers, "batch": batch, "seq": seq, "params_b": n_params / 1e9}

    graphs = args.mode in ("reduce-overhead", "max-autotune")  # Inductor's CUDA graph trees under both compilers
    mark_step = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)
    if args.mode:
        res["mode"] = args.mode

    def step(f):
        mark_step()
        loss = f(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    torch._dynamo.reset()
    inductor_emb = {"aten_embedding_backward": False}  # kosmos with Inductor's own embedding backward
    if args.mode:  # torch.compile takes mode= or options=, not both
        inductor_emb["inductor_config"] = torch._inductor.list_mode_options(args.mode)
    fns = {"eager": model, "inductor": torch.compile(model, mode=args.mode),
           "kosmos": torch.compile(model, backend="kosmos", mode=args.mode),
           "kosmos_inductor_emb": torch.compile(model, backend="kosmos", options=inductor_emb)}
    ref_loss = ref_norm = None
    for variant in args.variants:
        f = fns[variant]
        kosmos.reset_report()
        model.zero_grad(set_to_none=True)
        skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        loss = step(f).item()
        norm = grad_norm(model)
        if ref_loss is None:
            ref_loss, ref_norm = loss, norm
        res[f"loss_err_{variant}"] = abs(loss - ref_loss) / abs(ref_loss)
        res[f"grad_norm_err_{variant}"] = abs(norm - ref_norm) / ref_norm
        if graphs and variant != "eager":  # Inductor counts the graphs it declined to record
            res[f"cudagraph_skips_{variant}"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] - skips
        if variant.startswith("kosmos"):
            rep = kosmos.report()
            res[f"kosmos_embedding_{variant}"] = sorted({r.line()[:160] for r in rep.records if r.kind == "embedding"})
            res["kosmos_rewrites"] = {g: rep.count("moe_layer", g) for g in ("pre-grad", "forward", "backward")}
            res["kosmos_left_alone"] = sorted({r.line()[:160] for r in rep.left_alone if r.kind != "embedding"})
            res["kosmos_runs"] = sorted(f"{op} -> {impl} x{n} ({why})"[:200]
                                        for (op, impl, why), n in rep.runtime.items())

        def timed_step(f=f):
            model.zero_grad(set_to_none=True)
            step(f)

        if not args.tiny and not graphs:  # (a replay allocates nothing: no peak to read under CUDA graphs)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = f(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            res[f"saved_gib_{variant}"] = (torch.cuda.memory_allocated() - base) / 2**30  # what the backward keeps
            res[f"fwd_peak_gib_{variant}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            loss.backward()
            del loss
            torch.cuda.synchronize()
            res[f"peak_gib_{variant}"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            if args.peak_trace:
                peak, rows, where = live_at_peak(timed_step)
                res[f"peak_trace_{variant}"] = [f"peak {peak / 2**30:.2f} GiB above the step's start, at {where}"]
                res[f"peak_trace_{variant}"] += [f"{size / 2**30:7.3f} GiB in {n:>3} blocks from {src}"
                                                 for size, n, src in rows]
        if not args.tiny:
            res[f"step_ms_{variant}"] = bench_calls(timed_step, args.warmup, args.rep, args.min_reps)
            res[f"tok_s_{variant}"] = batch * seq / res[f"step_ms_{variant}"] * 1e3
        model.zero_grad(set_to_none=True)
    del fns, model
    torch._dynamo.reset()
    return res


def table(results) -> str:
    head = (f"{'model':>14} {'L':>2} {'tokens':>6} | {'variant':>19} {'step ms':>9} {'tok/s':>9} {'x ind':>6} "
            f"{'peak GiB':>9} {'fwd peak':>9} {'saved':>9} {'loss err':>9} {'|g| err':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        variants = [k[len("loss_err_"):] for k in r if k.startswith("loss_err_")]
        for v in variants:
            ms = r.get(f"step_ms_{v}", float("nan"))
            x = r.get("step_ms_inductor", float("nan")) / ms
            lines.append(f"{r['model']:>14} {r['layers']:>2} {r['batch'] * r['seq']:>6} | {v[:19]:>19} {ms:>9.2f} "
                         f"{r.get(f'tok_s_{v}', float('nan')):>9.0f} {x:>6.3f} "
                         f"{r.get(f'peak_gib_{v}', float('nan')):>9.2f} "
                         f"{r.get(f'fwd_peak_gib_{v}', float('nan')):>9.2f} "
                         f"{r.get(f'saved_gib_{v}', float('nan')):>9.2f} {r[f'loss_err_{v}']:>9.1e} "
                         f"{r[f'grad_norm_err_{v}']:>9.1e}")
        if r.get("mode"):
            lines.append(f"   torch.compile mode={r['mode']!r} for Inductor and kosmos; graphs not recorded: "
                         f"{r.get('cudagraph_skips_inductor')} / {r.get('cudagraph_skips_kosmos')}")
        if "kosmos_rewrites" in r:
            lines.append(f"   kosmos moe_layer rewrites {r['kosmos_rewrites']}; runs: " + "; ".join(r["kosmos_runs"]))
            lines += [f"   left alone: {line}" for line in r["kosmos_left_alone"]]
        for v in variants:
            lines += [f"   {v} {line}" for line in r.get(f"kosmos_embedding_{v}", [])]
            lines += [f"   {v} {line}" for line in r.get(f"peak_trace_{v}", [])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3_30b_a3b", help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--layers", type=int, default=4, help="decoder layers (DeepSeek-V3: the first is dense)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mode", default=None, help="torch.compile mode of Inductor and kosmos alike: reduce-overhead, ...")
    p.add_argument("--variants", default="eager,inductor,kosmos",
                   help="the first is the numerics reference; also kosmos_inductor_emb (kosmos with Inductor's own "
                        "embedding backward, aten_embedding_backward=False)")
    p.add_argument("--warmup", type=int, default=300, help="ms of warm-up steps")
    p.add_argument("--rep", type=int, default=1000, help="ms of timed steps (at least --min-reps)")
    p.add_argument("--min-reps", type=int, default=10)
    p.add_argument("--peak-trace", action="store_true",
                   help="list what is allocated at each variant's memory peak, by source line (peak_trace.py)")
    p.add_argument("--json", default="")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny dims, fp32: checks the script runs (no timing)")
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    import kosmos  # noqa: F401  (registers the backend)

    results = [run_model(m, args) for m in args.models.split(",")]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
