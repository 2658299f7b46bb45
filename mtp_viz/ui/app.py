"""A first Gradio page: run one strategy on one prompt and watch the tokens arrive.

The full explorer (timelines, replay, comparison) is its own piece of work; this page already
streams steps from the runner and renders them from the trace alone.
"""

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.registry import load_registry
from mtp_viz.runner import Run, RunRequest
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import MAX_NEW_TOKENS_LIMIT, GenerationSettings
from mtp_viz.trace import ORIGINS, Step

ORIGIN_COLOURS = {
    "autoregressive": "#9ca3af",
    "accepted": "#22c55e",
    "resampled": "#f97316",
    "bonus": "#3b82f6",
    "unverified": "#a855f7",
}
assert set(ORIGIN_COLOURS) == set(ORIGINS)
UI_MAX_NEW_TOKENS = 512


def token_spans(steps: list[Step]) -> list[tuple[str, str]]:
    """(text, origin) pairs for gr.HighlightedText, which escapes the text itself."""
    return [(t.text, t.origin) for s in steps for t in s.emitted]


def summary_markdown(summary: dict, strategy: str) -> str:
    lines = [
        f"**{strategy}**: {summary['new_tokens']} tokens in {summary['wall_time_s']:.2f} s "
        f"= **{summary['tokens_per_s']:.1f} tokens/s**",
        f"target forwards: {summary['target_forwards']}, mean accepted tokens: {summary['mean_accepted_tokens']:.2f}",
    ]
    if summary["drafted_tokens"]:
        lines.append(f"acceptance rate: {summary['acceptance_rate']:.1%} of {summary['drafted_tokens']} drafted")
    return "  \n".join(lines)


def run_stream(prompt: str, model: str, strategy: str, max_new_tokens: float, temperature: float, seed: float):
    """Gradio callback: stream (tokens, summary, trace JSON) while decoding runs."""
    try:
        request = RunRequest(
            prompt=prompt,
            model=model,
            strategy=strategy,
            generation=GenerationSettings(
                max_new_tokens=int(max_new_tokens), temperature=float(temperature), seed=int(seed)
            ),
        )
        run = Run(request)
    except UserError as e:
        raise gr.Error(str(e)) from None
    steps = []
    for step in run.steps():
        steps.append(step)
        yield token_spans(steps), f"step {step.index + 1}…", None
    trace = run.trace
    yield token_spans(trace.steps), summary_markdown(trace.summary, trace.strategy), trace.to_dict()


def build_app() -> gr.Blocks:
    registry = load_registry()
    model_ids = list(registry.models)
    with gr.Blocks(title="mtp-viz") as app:
        gr.Markdown("# mtp-viz\nSee how speculative decoding and multi-token prediction spend each forward pass.")
        with gr.Row():
            with gr.Column(scale=1):
                model = gr.Dropdown(model_ids, value=registry.default_for("cpu"), label="Model")
                strategy = gr.Dropdown(
                    [s for s, spec in STRATEGIES.items() if not spec.needs_draft],
                    value="autoregressive",
                    label="Strategy",
                )
                max_new = gr.Slider(1, min(UI_MAX_NEW_TOKENS, MAX_NEW_TOKENS_LIMIT), value=64, step=1,
                                    label="Max new tokens")  # fmt: skip
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                seed = gr.Number(0, precision=0, label="Seed")
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=4, value="What is speculative decoding?")
                go = gr.Button("Run", variant="primary")
                tokens = gr.HighlightedText(label="Tokens by origin", color_map=ORIGIN_COLOURS, combine_adjacent=False)
                summary = gr.Markdown()
                trace_json = gr.JSON(label="Trace")
        go.click(
            run_stream,
            [prompt, model, strategy, max_new, temperature, seed],
            [tokens, summary, trace_json],
            api_name="run",
            concurrency_limit=1,
        )
    return app
