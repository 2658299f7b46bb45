"""The Compare tab: one prompt through 2-4 strategies (autoregressive always first), side by side,
plus the distribution check that shows speculative sampling is lossless."""

import html

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.loading import load_model, model_name
from mtp_viz.quality import check_distribution
from mtp_viz.registry import Registry
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.speculative import MAX_DRAFT_TOKENS
from mtp_viz.trace import Trace
from mtp_viz.ui import notes
from mtp_viz.ui.comparison import MAX_COMPARED, Comparison, compare, comparison, uploaded_comparison
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.ui.requests import build_request
from mtp_viz.ui.trace_files import trace_file
from mtp_viz.viz import figures
from mtp_viz.viz.tokens import tokens_html

MAX_DISTRIBUTION_SAMPLES = 1000


def verdicts_html(v: dict[str, str]) -> str:
    items = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(s)}</li>" for k, s in v.items())
    return f"<ul>{items}</ul>"


def token_views(traces: list[Trace]) -> list:
    views = []
    for i in range(MAX_COMPARED):
        if i < len(traces):
            t = traces[i]
            views.append(gr.HTML(f"<h4>{html.escape(t.strategy)}</h4>" + tokens_html(t.steps), visible=True))
        else:
            views.append(gr.HTML("", visible=False))
    return views


def comparison_views(c: Comparison):
    """Token views, metrics table, speedup bars, verdicts and trace files of a finished comparison."""
    speed = figures.speedup_bars([t.strategy for t in c.traces], list(c.metrics["speedup"]))
    files = [trace_file(t) for t in c.traces]
    return (*token_views(c.traces), c.metrics, speed, verdicts_html(c.verdicts), files)


def build_compare(registry: Registry, default_model: str) -> gr.Blocks:
    model_choices = [(e.label, e.id) for e in registry.models.values()]
    first_draft = (registry.models[default_model].drafts or ("",))[0]
    others = [s for s in STRATEGIES if s != "autoregressive"]
    with gr.Blocks() as tab:
        gr.Markdown(notes.COMPARE)
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                model = gr.Dropdown(model_choices, value=default_model, label="Model (target)")
                draft = gr.Dropdown([("(none)", "")] + model_choices, value=first_draft, label="Draft model")
                strategies = gr.CheckboxGroup(
                    others, value=others[: MAX_COMPARED - 1], label="Strategies (autoregressive always runs first)"
                )
                num_draft = gr.Slider(1, MAX_DRAFT_TOKENS, value=5, step=1, label="Draft tokens per step")
                max_new = gr.Slider(1, 512, value=64, step=1, label="Max new tokens")
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature (0 = greedy)")
                seed = gr.Number(0, precision=0, minimum=0, label="Seed")
            with gr.Column(scale=3):
                prompt = gr.Textbox(
                    label="Prompt",
                    lines=4,
                    value="Repeat after me: the quick brown fox "
                    "jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
                )
                with gr.Row():
                    go = gr.Button("Compare", variant="primary")
                    stop = gr.Button("Stop", variant="stop")
                verdict_box = gr.HTML(elem_id="mv-verdicts")
                table = gr.Dataframe(label="Metrics", interactive=False)
                speed = gr.Plot(label="Speedup")
                with gr.Row():
                    downloads = gr.File(label="Download the traces (JSON)", file_count="multiple", interactive=False)
                    uploads = gr.File(
                        label="…or compare uploaded traces (2-4, one autoregressive)",
                        file_count="multiple",
                        file_types=[".json"],
                        type="filepath",
                    )
        with gr.Row():
            views = [gr.HTML(visible=False) for _ in range(MAX_COMPARED)]
        gr.Markdown("### Is speculative sampling lossless? The distribution check")
        gr.Markdown(notes.DISTRIBUTION)
        with gr.Row():
            samples = gr.Slider(20, MAX_DISTRIBUTION_SAMPLES, value=100, step=10, label="Samples per sampler")
            dist_temperature = gr.Slider(0.1, 2.0, value=1.0, step=0.05, label="Temperature")
            dist_go = gr.Button("Run the distribution check")
        dist_plot = gr.Plot(label="First sampled token")
        dist_verdict = gr.HTML(elem_id="mv-dist-verdict")

        # build_request's keyword → control (num_draft_tokens: shared, kept for the strategies that draft)
        request_inputs = {"prompt": prompt, "model": model, "draft": draft, "num_draft_tokens": num_draft}
        request_inputs |= {"max_new_tokens": max_new, "temperature": temperature, "seed": seed}

        @on_gpu
        def compare_run(strategies, *values):
            shown = 0  # traces whose token views are drawn
            given = dict(zip(request_inputs, values, strict=True))
            try:  # a yield per update: Stop lands within a step
                for message, traces, result in compare(strategies, **given):
                    if result is not None:
                        yield comparison_views(result)
                        continue
                    drawn = token_views(traces) if len(traces) > shown else [gr.skip()] * MAX_COMPARED
                    shown = len(traces)
                    yield (*drawn, gr.skip(), gr.skip(), f"<i>{html.escape(message)}</i>", gr.skip())
            except UserError as e:
                raise gr.Error(str(e)) from None

        @on_gpu
        def distribution(prompt, model, draft, k, samples, temperature, seed):
            try:
                request = build_request(
                    prompt,
                    model,
                    "speculative",
                    draft,
                    max_new_tokens=2,
                    temperature=temperature,
                    seed=seed,
                    settings={"num_draft_tokens": k},
                )
                result = check_distribution(request, int(samples))
            except UserError as e:
                raise gr.Error(str(e)) from None
            tok = load_model(model_name(request.model, request.device)).tokenizer
            fig = figures.distribution_histogram(
                {k: v for k, v in result.items() if k != "verdict"}, lambda t: tok.decode([t])
            )
            v = result["verdict"]
            lines = [
                f"{name} vs the exact target distribution: p = {t['p_value']:.3g} ({t['verdict']})"
                for name, t in v["first_token_vs_exact"].items()
            ]
            if "sequences_two_sample" in v:
                t = v["sequences_two_sample"]
                lines.append(f"first 2 tokens, autoregressive vs speculative: p = {t['p_value']:.3g} ({t['verdict']})")
            return fig, "<br>".join(html.escape(x) for x in lines) + f"<br><b>verdict: {html.escape(v['overall'])}</b>"

        event = go.click(
            compare_run,
            [strategies, *request_inputs.values()],
            [*views, table, speed, verdict_box, downloads],
            api_visibility="private",
            concurrency_limit=2,
        )

        def compare_uploaded(paths):
            try:
                return comparison_views(comparison(uploaded_comparison(paths), live=False))
            except UserError as e:
                raise gr.Error(str(e)) from None

        uploads.upload(
            compare_uploaded, uploads, [*views, table, speed, verdict_box, downloads], api_visibility="private"
        )
        stop.click(None, None, None, cancels=[event], api_visibility="private")
        dist_go.click(
            distribution,
            [prompt, model, draft, num_draft, samples, dist_temperature, seed],
            [dist_plot, dist_verdict],
            api_visibility="private",
            concurrency_limit=1,
        )
    return tab
