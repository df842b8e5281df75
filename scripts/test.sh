#!/usr/bin/env bash
# The CPU test suite (what CI runs): sets up .venv, then pytest; "no tests ran" counts as a failure.
# Without arguments the suite runs as two pytest processes at once: the Triton-interpreter modules (one Python
# thread each) beside the rest (torch ops, gloo process groups), so both cores of a CI machine work. With arguments,
# one pytest run of what they name.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1

check_rc() {  # check_rc RC NAME: pytest's exit code, with "no tests ran" (5) as a failure
  if [ "$1" -eq 5 ]; then
    echo "pytest ($2) collected no tests: failing" >&2
    return 1
  fi
  return "$1"
}

if [ "$#" -gt 0 ]; then
  .venv/bin/python -m pytest -q -ra "$@"
  check_rc $? "$*"
  exit $?
fi

interp=(tests/test_*_interpret.py)
ignore=()
for f in "${interp[@]}"; do ignore+=("--ignore=$f"); done
log=$(mktemp)
.venv/bin/python -m pytest -q -ra -p no:cacheprovider "${interp[@]}" > "$log" 2>&1 &
pid=$!
.venv/bin/python -m pytest -q -ra tests "${ignore[@]}"
check_rc $? "tests without the interpreter modules"
rc_rest=$?
wait "$pid"
rc_interp=$?
echo "== the interpreter modules (${interp[*]}):"
cat "$log"
rm -f "$log"
check_rc "$rc_interp" "interpreter modules"
rc_interp=$?
[ "$rc_rest" -eq 0 ] && [ "$rc_interp" -eq 0 ]
