#!/usr/bin/env bash
# The demo (main job): sets up .venv, then trains a TP+SP HF Qwen3 proxy compiled with kosmos.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m kosmos.demo "$@"
