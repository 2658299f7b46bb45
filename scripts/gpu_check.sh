#!/usr/bin/env bash
# GPU checks: what the CPU suite cannot try, as one prepared script for a CUDA machine, so the first
# GPU lent runs it in minutes. Every section runs under a time limit cut from one budget (BUDGET_S,
# default 540 s), so the script ends within it whatever hangs; a section the budget no longer covers
# is reported NOT RUN. DRY_RUN=1 prints the plan and runs nothing.
# Uses the machine's python3 with a CUDA torch (PYTHON=... for another); installs what is missing
# from WHEELS=dir (a folder of wheels carried along). Hub downloads are off (HF_HUB_OFFLINE=1, as a
# lent machine has no network): the Space's default pair needs its weights in the local HF cache
# (HF_HOME), else that section reports MISSING. The embedded model's weights cannot travel (the tool
# carries 64 MiB; its GGUF is 98 MB): STANDIN=dir (a folder made here by `python -m
# mtp_viz.loading.standin --carry .device` and carried) builds a stand-in of its shapes with random
# weights there, which the profile and bench sections then time (their acceptance and text mean
# nothing; a greedy tie may break differently in bf16). Writes to ${OUT:-gpu-check}/:
#   summary.txt     one line per section: PASS | FAIL | TIMEOUT | MISSING | NOT RUN, seconds, log
#   env.txt         GPU, driver, torch/transformers versions
#   tests.log       the gpu-marked tests: greedy identity on CUDA (fp32, bf16; eager, CUDA graphs),
#                   CUDA graphs across KV-cache growth (every lossless strategy, mtp_heads and mask_spec
#                   included; bf16 identity), the CUDA clock
#   default-pair.json, default-pair.log   the Space's default pair (models.yaml's cuda default and its
#                   first draft) as the Space runs it (bf16, weights auto), with CUDA graphs and eager,
#                   past the KV cache's initial capacity: speculative identical to autoregressive on
#                   each, and the graphs never fell back to eager
#   profile.json    the verify-cost curve and draft cost ratio on this GPU
#   bench-compile-{on,off}/  a short Spec-Bench run on the embedded model, CUDA, bf16, with the lean
#                   forward compiled (CUDA graphs) and eager, beside transformers' peers
# Exit status: 0 every section passed; 1 a section failed or timed out; 2 no usable CUDA torch;
# 3 nothing failed but a section was MISSING or NOT RUN.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
DRY_RUN=${DRY_RUN:-}
MIN_SECTION_S=20 # a section with less time left than this is not started
MISSING_RC=75    # what a section exits with when what it needs is not on this machine
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
mkdir -p "$OUT"
: >"$OUT/summary.txt"

record() { # record NAME STATUS SECONDS NOTE
    printf '%-14s %-8s %4ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$OUT/summary.txt"
}

# section NAME LIMIT_S LOG COMMAND...: run COMMAND under min(LIMIT_S, budget left), output to
# $OUT/LOG (and the terminal), and record how it ended.
section() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET_S - SECONDS))
    ((limit > left)) && limit=$left
    if ((limit < MIN_SECTION_S)); then
        record "$name" "NOT RUN" 0 "budget of ${BUDGET_S}s spent"
        return
    fi
    if [ -n "$DRY_RUN" ]; then
        record "$name" "DRY RUN" "$limit" "would run: $*"
        return
    fi
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS status
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$log"
    case ${PIPESTATUS[0]} in
        0) status=PASS ;;
        124 | 137) status=TIMEOUT ;;
        "$MISSING_RC") status=MISSING ;;
        *) status=FAIL ;;
    esac
    record "$name" "$status" $((SECONDS - start)) "$OUT/$log"
}

if [ -z "$DRY_RUN" ]; then
    if [ -n "${WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl >"$OUT/install.log" 2>&1
    fi
    "$PY" -m pip install -q --no-deps -e . >>"$OUT/install.log" 2>&1
    # pyproject's pytest options need these two plugins (-n, --timeout)
    "$PY" -c "import xdist, pytest_timeout" 2>/dev/null || "$PY" -m pip install -q \
        ${WHEELS:+--find-links "$WHEELS"} pytest-xdist==3.8.0 pytest-timeout==2.4.0 >>"$OUT/install.log" 2>&1
    timeout 60 "$PY" - <<'PYEOF' >"$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; echo "no usable CUDA torch"; exit 2; }
import torch, transformers
assert torch.cuda.is_available(), "CUDA is not available"
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__)
PYEOF
    if [ -n "${STANDIN:-}" ]; then # the embedded model as a stand-in: timings only (see above)
        export MTP_VIZ_CACHE="$(cd "$OUT" && pwd)/standin-cache"
        "$PY" -m mtp_viz.loading.standin --from "$STANDIN" --cache "$MTP_VIZ_CACHE" >>"$OUT/install.log" 2>&1 &&
            echo "$(basename "$STANDIN"): a stand-in of its shapes with random weights ($MTP_VIZ_CACHE)" >>"$OUT/env.txt"
    fi
    cat "$OUT/env.txt"
fi

# The Space's default pair on CUDA (PAIR_DEVICE=cpu tries the same steps on a CPU).
cat >"$OUT/default_pair.py" <<'PYEOF'
import json, os, sys
from mtp_viz.lean import MIN_CAPACITY
from mtp_viz.models import load_model
from mtp_viz.registry import load_registry
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings
from mtp_viz.weights import AUTO

device, out = os.environ.get("PAIR_DEVICE", "cuda"), sys.argv[1]
registry = load_registry()
model = registry.default_for(device)
draft = registry.models[model].drafts[0]
print(f"the Space's default pair on {device}: {model} with draft {draft}")
try:
    for name in (model, draft):
        load_model(name, device, weights=AUTO)
except Exception as e:  # offline without the weights: say so, distinctly from a failure
    print(f"cannot load {name} here ({type(e).__name__}: {e})")
    sys.exit(75 if os.environ.get("HF_HUB_OFFLINE") == "1" else 1)
prompt = "Count from 1 to 400, one number after another, separated by commas."
generation = GenerationSettings(max_new_tokens=MIN_CAPACITY + 64)  # past the KV cache's initial capacity
report, failures = {"device": device, "model": model, "draft": draft, "runs": []}, []
for compile in ("on", "off"):
    outputs = {}
    for strategy in ("autoregressive", "speculative"):
        trace = run(RunRequest(prompt=prompt, model=model, strategy=strategy, draft=draft if strategy != "autoregressive" else None,
                               generation=generation, device=device, compile=compile, weights=AUTO))
        outputs[strategy] = trace.output_token_ids
        length = len(trace.prompt_token_ids) + len(trace.output_token_ids)
        s = trace.summary
        row = {"compile": compile, "strategy": strategy, "compiled": trace.machine.get("compiled"),
               "compile_note": trace.machine.get("compile_note"), "kv_length": length, "new_tokens": s["new_tokens"],
               "tokens_per_s": s["tokens_per_s"], "mean_accepted_tokens": s["mean_accepted_tokens"],
               "dtype": trace.dtype, "weights": trace.machine.get("weights")}
        report["runs"].append(row)
        print(json.dumps(row))
        if compile == "on" and not trace.machine.get("compiled"):
            failures.append(f"{strategy}: compile on, but the run was eager ({trace.machine.get('compile_note')})")
        if length <= MIN_CAPACITY:
            failures.append(f"{strategy} with compile {compile}: {length} tokens never outgrew the cache ({MIN_CAPACITY})")
    if outputs["speculative"] != outputs["autoregressive"]:
        a, b = outputs["autoregressive"], outputs["speculative"]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        failures.append(f"compile {compile}: speculative parts from autoregressive at token {at}")
report["failures"] = failures
with open(out, "w") as f:
    json.dump(report, f, indent=1)
print("\n".join(failures) or "speculative identical to autoregressive, compiled and eager")
sys.exit(1 if failures else 0)
PYEOF

section gpu-tests 200 tests.log "$PY" -m pytest -m gpu -q -n0 -p no:cacheprovider tests/test_gpu.py
section default-pair 150 default-pair.log "$PY" "$OUT/default_pair.py" "$OUT/default-pair.json"
section profile 45 profile.log "$PY" -m mtp_viz profile --device cuda --dtype bfloat16 --model smollm2-135m \
    --draft smollm2-135m-draft --max-k 32 --repeats 5 --out "$OUT/profile.json"
for compile in on off; do # the lean forward with CUDA graphs, then eager: what compiling buys
    section "bench-$compile" 70 "bench-compile-$compile.log" "$PY" -m mtp_viz bench --device cuda --dtype bfloat16 \
        --model smollm2-135m --limit 1 --categories translation,summarization,qa,math_reasoning,rag,coding \
        --max-new-tokens 64 --compile $compile \
        --strategies speculative,prompt_lookup,prompt_lookup:num_draft_tokens=10,lookahead,mtp_heads,mtp_heads:tree=0,1,2,00,01,10,000,001,0000,conf_adapt \
        --peers hf_generate,hf_static_compile,hf_assisted,hf_prompt_lookup --out "$OUT/bench-compile-$compile"
done

if [ -z "$DRY_RUN" ]; then
    echo "== summary ($SECONDS s of a ${BUDGET_S}s budget; results in $OUT)"
    cat "$OUT/summary.txt"
fi
if grep -qE ' (FAIL|TIMEOUT) ' "$OUT/summary.txt"; then exit 1; fi
if grep -qE ' (MISSING|NOT RUN) ' "$OUT/summary.txt"; then exit 3; fi
exit 0
