#!/usr/bin/env bash
# One device call for the fused TP+SP kernels: GPU tests, then the one-GPU queue-overhead benchmark.
#   bash benchmarks/run_tp_sp_gpu.sh            (logs under $OUT, default /tmp/kosmos_tp_sp)
# NVLink multicast stays off (it can take a host's GPUs out of service).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kosmos_tp_sp}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
TESTS=${TESTS:-tests/test_fused_gpu.py}
timeout ${TEST_TIMEOUT:-280} python3 -m pytest -q -rfE -p no:cacheprovider $TESTS --timeout=150 \
    --junitxml="$OUT/junit.xml" -s 2>&1 > "$OUT/tests.log"
rc_tests=$?
grep -E "^(FAILED|ERROR)|Error|assert|500 launches|peak|fallback reason" "$OUT/tests.log" | head -60
tail -3 "$OUT/tests.log"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/tp_sp.py --mode queue --out "$OUT/tp_sp_queue.json" > "$OUT/bench.log" 2>&1
rc_bench=$?
tail -25 "$OUT/bench.log"
echo "tests rc=$rc_tests  bench rc=$rc_bench"
exit $(( rc_tests != 0 || rc_bench != 0 ))
