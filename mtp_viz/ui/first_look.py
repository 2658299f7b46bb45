"""What Explore opens on: a recorded example (assets/examples, scripts/make_example_traces.py)
drawn with no computation, with its speedup over the autoregressive run of the same prompt that
was recorded beside it, and the controls set to the example's own strategy, settings and prompt,
so that Run measures the same thing on this machine."""

import html
from dataclasses import dataclass, fields
from pathlib import Path

from mtp_viz.machine import machine_label, same_machine
from mtp_viz.registry import Registry
from mtp_viz.strategies import STRATEGIES
from mtp_viz.trace import Trace
from mtp_viz.ui.baselines import baseline_key

# the recorded example Explore opens on: the run that wins most on a general (non-repetitive)
# prompt, the MTP heads on a math-reasoning question (docs/BENCHMARKS.md, 2026-12-07); prompt
# lookup on a code edit, the repetitive case, is beside it in the examples
FIRST_LOOK = "mtp-heads-math-reasoning"
GENERATION = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "raw", "weights")  # controls a trace fixes


@dataclass(frozen=True)
class Example:
    name: str
    trace: Trace
    baseline: Trace | None  # the autoregressive run recorded beside it; None: no speedup to show


def recorded_baseline(trace: Trace, examples: dict[str, Path]) -> Trace | None:
    """The autoregressive example recorded beside `trace`: the same model, prompt, settings and
    engine (its baseline key) on the same machine record, as one run of the script records them;
    a speedup is only ever one session's two runs on one machine."""
    if trace.strategy == "autoregressive":
        return None
    for path in examples.values():
        other = Trace.load(path)
        same_run = same_machine(other.machine, trace.machine) and baseline_key(other) == baseline_key(trace)
        if other.strategy == "autoregressive" and same_run:
            return other
    return None


def open_example(name: str, examples: dict[str, Path]) -> Example:
    trace = Trace.load(examples[name])
    return Example(name, trace, recorded_baseline(trace, examples))


def recorded_speed(example: Example) -> dict[str, float]:
    """Baseline key → autoregressive tokens/s of the example's recorded baseline ({} without one)."""
    if example.baseline is None:
        return {}
    return {baseline_key(example.baseline): example.baseline.summary["tokens_per_s"]}


def control_values(trace: Trace, registry: Registry) -> dict:
    """The run controls' values a trace fixes (named as build_request takes them, its strategy's
    settings under "settings"): its strategy, settings and prompt; its models where registered here."""
    values = {"strategy": trace.strategy} | ({"prompt": trace.prompt_text} if trace.prompt_text else {})
    values |= {k: trace.settings[k] for k in GENERATION if k in trace.settings}
    values |= {k: m for k, m in (("model", trace.model), ("draft", trace.draft_model)) if m in registry.models}
    names = {f.name for f in fields(STRATEGIES[trace.strategy].settings_cls)}
    values["settings"] = {k: v for k, v in trace.settings.items() if k in names}
    return values


def note_html(example: Example) -> str:
    """The line above the example: recorded, not computed; what its speedup is measured against."""
    trace = example.trace
    against = (
        " Its speedup is over the autoregressive run of the same prompt recorded beside it on the same machine "
        f"({html.escape(machine_label(trace.machine))}: {example.baseline.summary['tokens_per_s']:.1f} tokens/s)."
        if example.baseline
        else ""
    )
    return (
        f"<div class='mv-first-look'>This is a <b>recorded example</b> ({html.escape(example.name)}: "
        f"{html.escape(trace.strategy)} on {html.escape(trace.model)}): the coloured tokens, the timeline and the "
        f"replay below are drawn from its trace, with no computation.{against} The controls hold its settings: "
        "<b>Run</b> measures it on this machine, or replaces it with your own.</div>"
    )
