"""The Compare tab: one prompt through 2-4 strategies (autoregressive always first), side by side,
plus the distribution check that shows speculative sampling is lossless."""

import html

import gradio as gr

from mtp_viz.deploy import deploy_costs
from mtp_viz.errors import UserError
from mtp_viz.models import load_model
from mtp_viz.quality import check_distribution, lossless_verdict
from mtp_viz.registry import Registry
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.speculative import MAX_DRAFT_TOKENS
from mtp_viz.trace import Trace
from mtp_viz.ui import notes, service
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.viz import figures
from mtp_viz.viz.tables import metrics_table
from mtp_viz.viz.tokens import tokens_html

MAX_COMPARED = 4  # autoregressive + 3 others
MAX_DISTRIBUTION_SAMPLES = 1000


def comparison_requests(strategies: list[str], **values):
    """Autoregressive first, then the chosen strategies, all with the same prompt and settings."""
    chosen = ["autoregressive"] + [s for s in dict.fromkeys(strategies) if s != "autoregressive"]
    if len(chosen) > MAX_COMPARED:
        raise UserError(f"compare at most {MAX_COMPARED - 1} strategies beside autoregressive")
    if len(chosen) < 2:
        raise UserError("pick at least one strategy to compare with autoregressive")
    return [service.build_request(strategy=s, **values) for s in chosen]


def verdicts(traces: list[Trace]) -> dict[str, str]:
    reference = traces[0]
    model = None
    out = {}
    for t in traces[1:]:
        if STRATEGIES[t.strategy].is_lossless(t.settings):
            if model is None and t.output_token_ids != reference.output_token_ids:
                try:
                    model = load_model(reference.model).model
                except UserError:  # an uploaded trace of a model this machine cannot load
                    model = None
            out[t.strategy] = lossless_verdict(reference, t, model)
        else:
            out[t.strategy] = "lossy by design: quality is measured, not assumed"
    return out


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


def comparison_views(traces: list[Trace], live: bool = True):
    """Token views, metrics table, speedup bars, verdicts and trace files for a finished comparison.
    Live runs also show what each strategy costs to deploy (from the models they just loaded);
    uploaded traces do not, so that opening one never loads, let alone downloads, a model."""
    views = token_views(traces)
    base = traces[0]
    table = metrics_table(traces, baseline=base, costs=deploy_costs(traces) if live else None)
    speed = figures.speedup_bars([t.strategy for t in traces], list(table["speedup"]))
    files = [service.trace_file(t) for t in traces]
    return (*views, table, speed, verdicts_html(verdicts(traces)), files)


def uploaded_comparison(paths: list[str] | None) -> list[Trace]:
    """Uploaded traces, the autoregressive one first as the baseline."""
    traces = [service.read_uploaded_trace(p) for p in paths or []]
    if not 2 <= len(traces) <= MAX_COMPARED:
        raise UserError(f"upload 2 to {MAX_COMPARED} traces, one of them autoregressive")
    traces.sort(key=lambda t: t.strategy != "autoregressive")
    if traces[0].strategy != "autoregressive":
        raise UserError("one of the uploaded traces must be an autoregressive run: it is the baseline")
    if len({tuple(t.prompt_token_ids) for t in traces}) > 1:
        raise UserError("the uploaded traces are of different prompts; compare runs of one prompt")
    return traces


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

        @on_gpu
        def compare_run(prompt, model, draft, strategies, k, max_new, temperature, seed):
            try:
                requests = comparison_requests(
                    strategies,
                    prompt=prompt,
                    model=model,
                    draft=draft,
                    max_new_tokens=max_new,
                    temperature=temperature,
                    seed=seed,
                    num_draft_tokens=k,  # a shared control: kept for the strategies that draft
                )
                traces = []
                for r in requests:
                    for steps, trace in service.stream(r):  # a yield per update: Stop lands within a step
                        if trace is None:
                            progress = f"<i>{html.escape(r.strategy)}: step {len(steps)}…</i>"
                            yield (*[gr.skip()] * MAX_COMPARED, gr.skip(), gr.skip(), progress, gr.skip())
                    traces.append(trace)
                    progress = f"<i>finished {len(traces)} of {len(requests)}…</i>"
                    yield (*token_views(traces), gr.skip(), gr.skip(), progress, gr.skip())
                yield comparison_views(traces)
            except UserError as e:
                raise gr.Error(str(e)) from None

        @on_gpu
        def distribution(prompt, model, draft, k, samples, temperature, seed):
            try:
                request = service.build_request(
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
            tok = load_model(request.model or registry.default_for("cpu")).tokenizer
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
            [prompt, model, draft, strategies, num_draft, max_new, temperature, seed],
            [*views, table, speed, verdict_box, downloads],
            api_visibility="private",
            concurrency_limit=2,
        )

        def compare_uploaded(paths):
            try:
                return comparison_views(uploaded_comparison(paths), live=False)
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
