#!/usr/bin/env bash
# One device call on a host with >= 2 GPUs: the multi-GPU tests, the TP+SP benchmark under torchrun and the 2-GPU
# demo, one after another, each bounded by `timeout`. Logs, JSON and the plot go under $OUT (few files), and a short
# summary comes last.
#   bash benchmarks/run_multi_gpu.sh        (carry .whl: the pytest / expecttest wheels)
# Steps can be left out: SKIP_TESTS=1, SKIP_BENCH=1, SKIP_DEMO=1. Bounds in s: TEST_TIMEOUT (240), BENCH_TIMEOUT
# (150), DEMO_TIMEOUT (120): at most about 9 min with setup, typically less (the summary gives each step's time).
# SHAPES=small|full picks the benchmark grid, NGPU the ranks (default: every GPU), PYTEST_K a pytest -k
# expression. NVLink multicast stays off: it can take a host's GPUs out of service.
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -o pipefail
OUT=${OUT:-/tmp/kosmos_mgpu}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

{ nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader
  nvidia-smi topo -m
  python3 -c "import torch, triton, pytest as p; print('torch', torch.__version__, 'triton', triton.__version__,
      'pytest', p.__version__, 'GPUs', torch.cuda.device_count())"
} > "$OUT/gpus.txt" 2>&1
cat "$OUT/gpus.txt"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)}
NGPU=${NGPU:-0}
if [ "$NGPU" -lt 2 ]; then
    note "only $NGPU GPU(s): the multi-GPU steps need 2 or more"
    exit 1
fi

leftovers() {  # processes still on the GPUs after a step (a killed step's ranks would skew the next one)
    local apps
    apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
    [ -n "$apps" ] && note "   still on the GPUs after $1: $(echo "$apps" | tr '\n' ';')"
}

rc_tests=skip rc_bench=skip rc_demo=skip

# 1. tests/test_multi_gpu.py: each test spawns its ranks (tests/_dist.run_ranks, 150 s bound per call); -s -v so
#    the log has each result, the ranks' output and any stack dump as they come, even if the timeout cuts it short
if [ -z "$SKIP_TESTS" ]; then
    t=$SECONDS
    timeout -k 20 "${TEST_TIMEOUT:-240}" python3 -m pytest -m multi_gpu tests/test_multi_gpu.py -v -s -rfE \
        -p no:cacheprovider --durations=12 --junitxml="$OUT/junit_multi_gpu.xml" ${PYTEST_K:+-k "$PYTEST_K"} \
        > "$OUT/tests.log" 2>&1
    rc_tests=$?
    note "== tests: rc $rc_tests, $((SECONDS - t)) s: $(tail -1 "$OUT/tests.log")"
    grep -E "^(FAILED|ERROR)|(PASSED|FAILED|ERROR)$" "$OUT/tests.log" | cut -c1-300 | head -40 | tee -a "$SUMMARY"
    leftovers tests
fi

# 2. benchmarks/tp_sp.py --mode dist: NCCL + cuBLAS, GEMM and collective alone, async-TP, kosmos; per rank a
#    faulthandler limit inside the outer timeout dumps the stacks of a hung rank before torchrun is stopped
if [ -z "$SKIP_BENCH" ]; then
    t=$SECONDS
    limit=${BENCH_TIMEOUT:-150}
    timeout -k 20 "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node="$NGPU" \
        benchmarks/tp_sp.py --mode dist --shapes "${SHAPES:-small}" --time-limit $((limit - 15)) \
        --out "$OUT/tp_sp_dist.json" --plot "$OUT/tp_sp_dist.png" > "$OUT/bench.log" 2>&1
    rc_bench=$?
    note "== tp_sp dist benchmark: rc $rc_bench, $((SECONDS - t)) s"
    leftovers benchmark
fi

# 3. the demo: HF Qwen3 proxy, TP+SP over 2 NCCL ranks, compiled with kosmos, losses against eager
if [ -z "$SKIP_DEMO" ]; then
    t=$SECONDS
    timeout -k 10 "${DEMO_TIMEOUT:-120}" python3 -m kosmos.demo --device cuda --world-size 2 > "$OUT/demo.log" 2>&1
    rc_demo=$?
    note "== demo: rc $rc_demo, $((SECONDS - t)) s: $(grep -E '^(OK|FAILED):' "$OUT/demo.log" | tail -1)"
    leftovers demo
fi

# (further steps go here, each setting its rc_* and adding its line to the summary)

note ""
note "summary ($SECONDS s in all)"
if [ "$rc_tests" != skip ] && [ -f "$OUT/junit_multi_gpu.xml" ]; then
    python3 - "$OUT/junit_multi_gpu.xml" <<'EOF' | tee -a "$SUMMARY"
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"tests: {passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
for s in suites:
    for case in s.iter("testcase"):
        bad = [c.tag for c in case if c.tag in ("failure", "error")]
        if bad:
            print(f"  {bad[0]}: {case.get('name')} ({float(case.get('time', 0)):.0f} s)")
EOF
fi
if [ "$rc_bench" != skip ]; then
    sed -n '/^TP+SP: bf16/,$p' "$OUT/bench.log" | tee -a "$SUMMARY"
    grep -q '^TP+SP: bf16' "$OUT/bench.log" ||
        { grep -m1 -A14 '^Traceback' "$OUT/bench.log"; tail -4 "$OUT/bench.log"; } | cut -c1-300 | tee -a "$SUMMARY"
fi
[ "$rc_demo" != skip ] && { grep -E '^(OK|FAILED):' "$OUT/demo.log" || tail -8 "$OUT/demo.log"; } | tee -a "$SUMMARY"
note "rc: tests=$rc_tests bench=$rc_bench demo=$rc_demo"
for rc in $rc_tests $rc_bench $rc_demo; do
    [ "$rc" = skip ] || [ "$rc" -eq 0 ] || exit 1
done
exit 0
