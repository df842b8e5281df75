#!/usr/bin/env bash
# One device call on a machine with >= 2 GPUs: expert-parallel kosmos::moe_layer on real NCCL groups.
#   bash benchmarks/run_multi_gpu_ep.sh          (logs under $OUT, default /tmp/kosmos_ep; summary last)
# 1. pytest tests/test_multi_gpu_ep.py: fused EP op vs the reference, refusals, compiled HF Qwen3-MoE, a dropped
#    signal (bounded by TEST_TIMEOUT, default 390 s)
# 2. torchrun benchmarks/moe_ep.py --dist on NPROC GPUs (default: all), BENCH_ARGS replacing the cell list
#    (bounded by BENCH_TIMEOUT, default 190 s; the JSON keeps every finished cell)
# SKIP_TESTS=1 / SKIP_BENCH=1 leave a step out. Files in $OUT: env.txt, tests_ep.log, junit_ep.xml, bench_ep.log,
# moe_ep_dist.json, moe_ep_dist.png. NVLink multicast stays off (it can take a host's GPUs out of service).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# one Triton cache for every process of both steps (Inductor would point each process at a cache of its own)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kosmos_ep_triton_cache}
OUT=${OUT:-/tmp/kosmos_ep}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
{
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
    nvidia-smi topo -m
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt" 2>&1
rc_test=skipped rc_bench=skipped
t0=$SECONDS

if [ -z "$SKIP_TESTS" ]; then
    # timeout signals the whole process group: the spawned rank processes end with pytest
    # -s: the ranks print one line per finished case, so a run cut short still shows what each rank saw
    timeout -k 15 "${TEST_TIMEOUT:-390}" python3 -m pytest -s -v -rA -p no:cacheprovider -o faulthandler_timeout=300 \
        --durations=10 --junitxml="$OUT/junit_ep.xml" tests/test_multi_gpu_ep.py > "$OUT/tests_ep.log" 2>&1
    rc_test=$?
fi
t1=$SECONDS
if [ -z "$SKIP_BENCH" ]; then
    # shellcheck disable=SC2086
    timeout -k 15 "${BENCH_TIMEOUT:-190}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
        --max-restarts 0 benchmarks/moe_ep.py --dist \
        ${BENCH_ARGS:---layers qwen3_30b_a3b,qwen3_235b,deepseek_v3 --tokens 4096,16384} \
        --json "$OUT/moe_ep_dist.json" --plot "$OUT/moe_ep_dist.png" > "$OUT/bench_ep.log" 2>&1
    rc_bench=$?
fi
t2=$SECONDS

echo "== machine"; head -3 "$OUT/env.txt"; tail -1 "$OUT/env.txt"
left=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
[ -n "$left" ] && echo "GPU processes still running after the steps: $left"
if [ -z "$SKIP_TESTS" ]; then
    echo "== tests/test_multi_gpu_ep.py: rc $rc_test, $((t1 - t0)) s"
    # pytest's short summary (-rA): one line per test, failures with their message
    sed -n '/short test summary info/,$p' "$OUT/tests_ep.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" \
        | sed 's/tests\/test_multi_gpu_ep.py:://' | cut -c1-400 | head -40
    grep -oE '\[rank [0-9]+\] .*"error".*' "$OUT/tests_ep.log" | cut -c1-900 | head -6
    grep -q "short test summary info" "$OUT/tests_ep.log" || {
        echo "(pytest was cut short; the ranks' last progress lines:)"
        grep -oE '\[rank [0-9]+\] .*' "$OUT/tests_ep.log" | cut -c1-300 | tail -12
    }
    tail -1 "$OUT/tests_ep.log"
fi
if [ -z "$SKIP_BENCH" ]; then
    echo "== benchmark: rc $rc_bench, $((t2 - t1)) s"
    grep -E "Error|error|Traceback" "$OUT/bench_ep.log" | grep -v '"error"' | cut -c1-300 | head -8
    if [ -s "$OUT/moe_ep_dist.json" ]; then  # the table, also when the run was cut short
        python3 -c "import json, sys; sys.path.insert(0, 'benchmarks'); import moe_ep_dist as m; \
print(m.table(json.load(open('$OUT/moe_ep_dist.json'))['rows']))"
    else
        tail -20 "$OUT/bench_ep.log"
    fi
fi
echo "tests rc=$rc_test bench rc=$rc_bench total $((t2 - t0)) s"
[ "$rc_test" = 0 ] || [ "$rc_test" = skipped ] || exit 1
[ "$rc_bench" = 0 ] || [ "$rc_bench" = skipped ] || exit 1
exit 0
