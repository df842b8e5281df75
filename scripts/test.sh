#!/usr/bin/env bash
# The CPU test suite (what CI runs): sets up .venv, then pytest; "no tests ran" counts as a failure.
# With no arguments the suite runs in two steps: the tests that run in one process, as two pytest processes at once
# (most of such a test's time is single-threaded Dynamo, AOT and Inductor Python: one process leaves a core idle);
# then the tests that spawn gloo ranks (which fill both cores themselves; marked multiproc), as one pytest.
# Arguments run one pytest with them. KOSMOS_TEST_SHARDS=1 runs the whole suite as one pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1

run_pytest() {
  .venv/bin/python -m pytest -q -ra "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests ($*): failing" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ] || [ "$(nproc)" -lt 2 ] || [ "${KOSMOS_TEST_SHARDS:-2}" = 1 ]; then
  run_pytest "$@"
  exit $?
fi

# About half of the single-process tests' time (tests/test_moe_numerics.py is a third of it); new files join the
# other half. The tests that spawn gloo ranks carry the multiproc marker (tests/_dist.py's run_ranks refuses them to
# a test without it), wherever they are.
half=(tests/test_moe_numerics.py tests/test_moe_kernel_interpret.py tests/test_kernels_interpret.py
      tests/test_backend.py tests/test_moe_families.py)
ignores=()
for f in "${half[@]}"; do
  [ -f "$f" ] || { echo "scripts/test.sh: $f is gone: update its list" >&2; exit 1; }
  ignores+=("--ignore=$f")
done

log=$(mktemp /tmp/kosmos_tests.XXXXXX)
trap 'rm -f "$log"' EXIT
echo "===== 1/3 and 2/3 at once: single-process tests (2/3's output follows 1/3's) ====="
# one intra-op thread each: two processes of two OpenMP threads would oversubscribe the cores
OMP_NUM_THREADS=1 run_pytest -m "not multiproc" "${half[@]}" > "$log" 2>&1 &
pid2=$!
OMP_NUM_THREADS=1 run_pytest -m "not multiproc" tests "${ignores[@]}" &
pid1=$!
# both in the background, so that a signal reaches this trap at once (not after a foreground pytest ends) and an
# interrupted run takes both pytest processes with it
trap 'pkill -P "$pid1"; pkill -P "$pid2"; kill "$pid1" "$pid2" 2>/dev/null; exit 130' INT TERM
wait "$pid1"
rc1=$?
wait "$pid2"
rc2=$?
trap - INT TERM
echo "===== 2/3: ${half[*]} ====="
cat "$log"
echo "===== 3/3: tests that spawn gloo ranks (marked multiproc) ====="
run_pytest -m multiproc tests
rc3=$?
echo "scripts/test.sh: exit codes $rc1 / $rc2 / $rc3"
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ] && [ "$rc3" -eq 0 ]
