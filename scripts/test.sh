#!/usr/bin/env bash
# The CPU test suite (what CI runs): sets up .venv, then pytest; "no tests ran" counts as a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || exit 1
.venv/bin/python -m pytest -q -ra "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
