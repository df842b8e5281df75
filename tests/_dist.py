"""Helpers for distributed tests: gloo (CPU) or NCCL (one GPU a rank) process groups on this machine, and
tiny HF models built from configs.

    results = run_ranks(fn, world_size, *args)   # fn(rank, world_size, *args) in each of `world_size` processes
    results = run_ranks(fn, 2, backend="nccl", timeout=120)   # rank r on cuda:r
    model = tiny_hf_model("qwen3", seed=0)       # random weights, nothing downloaded

Each rank runs in a fresh `spawn`ed process with a default process group on a FileStore, one intra-op
thread (CI has 2 cores), and returns `fn`'s result (anything torch.save can write); `run_ranks` returns the
list of results ordered by rank. An exception in any rank fails the call with that rank's traceback; past
`timeout` seconds every rank is killed and the call fails (a hang never outlives its test). `fn` must be
importable by name (a module-level function). NVLink multicast stays off in NCCL ranks.
"""
from __future__ import annotations

import atexit
import faulthandler
import functools
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# (node id, whether it carries the `multiproc` marker) of the pytest test being set up or run; conftest.py sets it.
# scripts/test.sh runs the multiproc tests on their own, since their gloo ranks fill the cores themselves.
current_test: tuple[str, bool] | None = None


def _worker(rank: int, world_size: int, store_path: str, result_dir: str, fn: Callable, args: tuple, threads: int,
            backend: str = "gloo") -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a native abort still shows the Python stacks
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # run_ranks' timeout dumps stacks
    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    if backend == "nccl":
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    except BaseException:
        # mp.spawn shows the exception too, but the full chained traceback is easier to read from the file
        with open(os.path.join(result_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: about 1 run in 15, torch 2.13's static destructors abort there
    # ("terminate called without an active exception", no Python frame) after the work is done.
    multiprocessing.util._exit_function()  # multiprocessing's own exit handlers (semaphores, queues)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@functools.cache
def _ranks_inductor_cache() -> str:
    """The Inductor cache folder of every run_ranks call of this process, removed when it exits."""
    path = tempfile.mkdtemp(prefix="kosmos_ranks_inductor_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def run_ranks(fn: Callable, world_size: int, *args: Any, threads: int = 1, backend: str = "gloo",
              timeout: float | None = None) -> list:
    """Runs fn(rank, world_size, *args) on `world_size` ranks of `backend`; returns their results by rank.

    The ranks of every call from this process share a private Inductor cache (a fresh folder, so runs beside
    this one cannot race on its files): a C++ kernel that one rank or an earlier call compiled is loaded, not
    built again (about a fifth of tests/test_numerics_gloo.py's time on 2 cores). Not its FX graph cache: a
    graph loaded from another compile would skip the kosmos passes, and that rank's kosmos.report() would miss
    the rewrites."""
    if backend == "gloo" and world_size > 1 and current_test is not None and not current_test[1]:
        raise RuntimeError(f"{current_test[0]} spawns {world_size} gloo ranks: mark it @pytest.mark.multiproc "
                           "(scripts/test.sh runs those tests on their own)")
    with tempfile.TemporaryDirectory(prefix="kosmos_dist_") as tmp:
        store_path = os.path.join(tmp, "store")
        env = {"TORCHINDUCTOR_CACHE_DIR": _ranks_inductor_cache(), "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            ctx = mp.start_processes(_worker, args=(world_size, store_path, tmp, fn, args, threads, backend),
                                     nprocs=world_size, join=False, start_method="spawn")
            deadline = None if timeout is None else time.monotonic() + timeout
            while not ctx.join(timeout=1.0):
                if deadline is not None and time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            os.kill(p.pid, signal.SIGUSR1)
                    time.sleep(2.0)
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise TimeoutError(f"ranks still running after {timeout} s: killed")
        except Exception as e:
            errs = sorted(f for f in os.listdir(tmp) if f.endswith(".err"))
            detail = "\n".join(open(os.path.join(tmp, f)).read() for f in errs[:1])
            raise RuntimeError(f"rank(s) failed: {errs or e}\n{detail}") from e
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


# ---------------------------------------------------------------------------------------------
# Tiny HF models (random weights from a seed; built from configs, nothing is downloaded)

VOCAB, SEQ = 256, 16


def tiny_hf_model(family: str, *, seed: int = 0, num_key_value_heads: int = 2, tie: bool = False, **overrides):
    """A 2-layer proxy of `family` ("qwen3", "qwen3_moe", "deepseek_v3"): hidden 64, 4 heads of 16, vocab 256.

    Qwen3-MoE: layer 0 dense, layer 1 sparse (4 experts, top-2). DeepSeek-V3: MLA (q_lora 32, kv_lora
    16), layer 0 dense (first_k_dense_replace=1), layer 1 MoE (4 routed experts, top-2, 1 shared)."""
    import transformers as T

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, intermediate_size=128,
    )
    if family == "qwen3":
        cfg = T.Qwen3Config(**{**common, "num_key_value_heads": num_key_value_heads, "head_dim": 16, **overrides})
        cls = T.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        moe = dict(
            num_key_value_heads=num_key_value_heads, head_dim=16, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True,
        )
        cfg = T.Qwen3MoeConfig(**{**common, **moe, **overrides})
        cls = T.Qwen3MoeForCausalLM
    elif family == "deepseek_v3":
        mla = dict(
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        )
        cfg = T.DeepseekV3Config(**{**common, **mla, **overrides})
        cls = T.DeepseekV3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    return cls(cfg)


def ep_grad_errors(model, ref) -> dict:
    """Relative error (fp64 norms) of every gradient of `model` (kosmos.parallelize(expert_parallel=True), maybe
    compiled: names without the `_orig_mod.` prefix) against the unsharded reference model's: an expert shard
    (`_kosmos_ep`) against its experts' rows, any other gradient gathered whole; inf where one is missing."""
    from kosmos.parallel import full_tensor

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    ref_params = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        name = name.removeprefix("_orig_mod.")
        r = ref_params[name].grad
        ep = getattr(p, "_kosmos_ep", None)
        if p.grad is None:
            errs[name] = float("inf")
        elif ep is not None:
            errs[name] = rel(p.grad, r[ep[2]: ep[2] + p.shape[0]])
        else:
            errs[name] = rel(full_tensor(p.grad), r)
    return errs
