"""Record the example traces shipped in assets/examples (they render without running a model).

The autoregressive run of a prompt is recorded in the same process as the strategies on that
prompt, just before them: the app shows their speedup over it (mtp_viz.ui.first_look pairs a trace
with the autoregressive one of the same prompt, settings and machine record), so re-record them
together, on an otherwise quiet machine.

.venv/bin/python scripts/make_example_traces.py
"""

from pathlib import Path

from mtp_viz.loading import quiet_transformers
from mtp_viz.prompts import CODE_EDIT_PROMPT, spec_bench_prompt
from mtp_viz.runner import RunRequest, run
from mtp_viz.strategies.base import GenerationSettings

OUT = Path(__file__).resolve().parent.parent / "assets" / "examples"
EXAMPLES = {
    "autoregressive-code-edit": RunRequest(prompt=CODE_EDIT_PROMPT, generation=GenerationSettings(max_new_tokens=96)),
    "prompt-lookup-code-edit": RunRequest(
        prompt=CODE_EDIT_PROMPT, strategy="prompt_lookup", generation=GenerationSettings(max_new_tokens=96)
    ),
    "eagle-code-edit": RunRequest(
        prompt=CODE_EDIT_PROMPT, strategy="eagle", generation=GenerationSettings(max_new_tokens=96)
    ),
    # a general prompt (Spec-Bench's first math-reasoning question): where the trained heads won most
    # on Spec-Bench on a CPU (docs/BENCHMARKS.md, 2026-12-07); Explore opens on it (ui.first_look)
    "autoregressive-math-reasoning": RunRequest(
        prompt=spec_bench_prompt(401), generation=GenerationSettings(max_new_tokens=128)
    ),
    "mtp-heads-math-reasoning": RunRequest(
        prompt=spec_bench_prompt(401), strategy="mtp_heads", generation=GenerationSettings(max_new_tokens=128)
    ),
    "speculative-early-exit-sampling": RunRequest(
        prompt=spec_bench_prompt(121),
        strategy="speculative",
        strategy_settings={"num_draft_tokens": 4},
        generation=GenerationSettings(max_new_tokens=64, temperature=0.7, top_p=0.9, seed=1),
    ),
}


def main() -> None:
    quiet_transformers()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, request in EXAMPLES.items():
        trace = run(request)
        trace.save(OUT / f"{name}.json")
        s = trace.summary
        print(
            f"{name}: {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s, "
            f"acceptance {s['acceptance_rate']:.0%}, mean accepted {s['mean_accepted_tokens']:.2f}"
        )


if __name__ == "__main__":
    main()
