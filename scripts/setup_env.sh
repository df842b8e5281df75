#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and kosmos (editable) plus test deps; reused when present.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import kosmos, expecttest, transformers" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # torch 2.13.0 is the CPU wheel (small, cached on the CI image); the rest comes from pyproject.toml
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[test]'
fi
