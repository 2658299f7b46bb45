#!/usr/bin/env bash
# GPU checks, as one prepared script for a CUDA machine (run from the repository root; < 8 min).
# Uses the machine's python3 with a CUDA torch; installs what is missing from WHEELS=dir (a
# folder of wheels carried along) or from the package index. Writes to ${OUT:-gpu-check}/:
#   env.txt        GPU, driver, torch/transformers versions
#   tests.log      the gpu-marked tests (greedy identity on CUDA in fp32 and bf16, clock sanity)
#   bench-compile-{on,off}/  a short Spec-Bench run on the embedded model, CUDA, bf16, with the lean
#                  forward compiled (CUDA graphs) and eager, beside transformers' peers (tables + traces)
#   profile.json   the verify-cost curve and draft cost ratio on this GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl >"$OUT/install.log" 2>&1
fi
"$PY" -m pip install -q --no-deps -e . >>"$OUT/install.log" 2>&1
"$PY" - <<'PYEOF' >"$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; echo "no usable CUDA torch"; exit 2; }
import torch, transformers
assert torch.cuda.is_available(), "CUDA is not available"
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
PYEOF
cat "$OUT/env.txt"
status=0
timeout 240 "$PY" -m pytest -m gpu -q tests/test_gpu.py 2>&1 | tee "$OUT/tests.log" || status=1
timeout 60 "$PY" -m mtp_viz profile --device cuda --dtype bfloat16 --model smollm2-135m \
    --draft smollm2-135m-draft --max-k 32 --repeats 5 --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.log" || status=1
for compile in on off; do  # the lean forward with CUDA graphs, then eager: what compiling buys
    timeout 150 "$PY" -m mtp_viz bench --device cuda --dtype bfloat16 --model smollm2-135m --limit 1 \
        --categories translation,summarization,qa,math_reasoning,rag,coding --max-new-tokens 128 --compile $compile \
        --strategies speculative,prompt_lookup,prompt_lookup:num_draft_tokens=10,lookahead,mtp_heads,mtp_heads:tree=0,1,2,00,01,10,000,001,0000,conf_adapt \
        --peers hf_generate,hf_static_compile,hf_assisted,hf_prompt_lookup --out "$OUT/bench-compile-$compile" 2>&1 \
        | tee "$OUT/bench-compile-$compile.log" || status=1
done
echo "gpu check finished with status $status; results in $OUT"
exit $status
