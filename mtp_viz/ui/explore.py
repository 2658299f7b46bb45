"""The Explore tab: one strategy on one prompt, streamed, then timelines and a step-by-step replay."""

import html

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.prompts import spec_bench
from mtp_viz.registry import Registry
from mtp_viz.runner import MAX_PROMPT_CHARS
from mtp_viz.serving.backend import BACKEND_OURS, BACKEND_VLLM
from mtp_viz.serving.methods import NOT_SERVED, SERVED
from mtp_viz.strategies import STRATEGIES
from mtp_viz.strategies.base import MAX_NEW_TOKENS_LIMIT
from mtp_viz.trace import Trace
from mtp_viz.ui import controls, notes
from mtp_viz.ui.baselines import as_baseline, baseline_key, request_baseline_key
from mtp_viz.ui.first_look import FIRST_LOOK, control_values, note_html, open_example, recorded_speed
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.ui.requests import build_request
from mtp_viz.ui.results import example_traces
from mtp_viz.ui.streaming import run_to_end, stream, stream_vllm
from mtp_viz.ui.trace_files import MAX_TRACE_BYTES, read_uploaded_trace, trace_file
from mtp_viz.viz import figures
from mtp_viz.viz.tables import summary_html
from mtp_viz.viz.tokens import PHASES, step_detail_html, tokens_html, walkthrough_html
from mtp_viz.weights import AUTO
from mtp_viz.weights import CHOICES as WEIGHT_CHOICES

UI_MAX_NEW_TOKENS = min(1024, MAX_NEW_TOKENS_LIMIT)
DEFAULT_PROMPT = "Explain speculative decoding in two sentences."
EXAMPLE_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag", "coding", "writing")
NEEDS_DRAFT = {n for n, s in STRATEGIES.items() if s.needs_draft}


def example_prompts() -> list[list[str]]:
    """One Spec-Bench question per category (Apache-2.0; attribution in mtp_viz/data/README.md)."""
    firsts = {}
    for q in spec_bench():
        firsts.setdefault(q["category"], q["turns"][0])
    return [[firsts[c]] for c in EXAMPLE_CATEGORIES if c in firsts]


def default_strategy(registry: Registry, model: str) -> str:
    """The strategy that best shows the idea with this model here: its trained MTP heads (the
    fastest lossless strategy measured on the CPU, docs/BENCHMARKS.md), else its draft model,
    else prompt lookup, which needs nothing."""
    entry = registry.models.get(model)
    if entry is not None and entry.heads:
        return "mtp_heads"
    if entry is not None and entry.drafts:
        return "speculative"
    return "prompt_lookup"


def vllm_note() -> str:
    """Which strategies a vLLM server runs, and why the others cannot (listed, not hidden)."""
    served = ", ".join(f"`{s}`" + (f" (its `{m.method}`)" if m.method else "") for s, m in SERVED.items())
    missing = "; ".join(f"`{s}`: {why}" for s, why in NOT_SERVED.items())
    return (
        f"**On vLLM** (its own environment, `bash scripts/setup.sh --vllm`; ~2 min to start on a CPU): "
        f"{served}. It reports drafted and accepted counts per step, not probabilities or per-step times. "
        f"**Not on vLLM:** {missing}."
    )


def starting_values(registry: Registry, default_model: str, first: Trace | None) -> dict:
    """What the run controls start from (named as build_request takes them): the first look's own
    values where there is one, so they show what it ran; the app's defaults elsewhere."""
    values = dict(model=default_model, strategy=default_strategy(registry, default_model), settings={})
    values |= dict(prompt=DEFAULT_PROMPT, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    values |= dict(raw=False, weights=AUTO) | (control_values(first, registry) if first else {})
    if not runs_here(registry, values["model"], values["strategy"], values["settings"]):
        # the example's strategy drafts with what this registry's model lacks (its model is not
        # registered here, or registered without that drafter): its prompt and generation stay
        values |= dict(strategy=default_strategy(registry, values["model"]), settings={})
    values.setdefault("draft", (registry.models[values["model"]].drafts or ("",))[0])  # the model's first
    return values


def runs_here(registry: Registry, model: str, strategy: str, settings: dict) -> bool:
    """Whether `model` has a drafter `strategy` drafts with (with these settings; a draft model
    can be any registered model, so a strategy that takes one always can)."""
    info = STRATEGIES[strategy]
    if info.needs_draft or not info.drafter:
        return True
    try:
        kinds = info.drafters(info.settings_cls(**settings))
    except (TypeError, ValueError):  # settings it does not take: its defaults'
        kinds = info.drafters(info.settings_cls())
    entry = registry.models.get(model)
    return entry is not None and any(entry.drafters(kind) for kind in kinds)


def render(trace: Trace, baselines: dict[str, float]):
    """Everything the tab shows for a finished (or uploaded) trace."""
    last = max(0, len(trace.steps) - 1)
    first = next((i for i, step in enumerate(trace.steps) if step.drafted), 0)  # the replay opens on a decision
    return (
        tokens_html(trace.steps, selected=first),
        summary_html(trace, baselines.get(baseline_key(trace))),
        figures.step_timeline(trace),
        figures.position_acceptance(trace),
        figures.accepted_length_histogram(trace),
        gr.Slider(minimum=0, maximum=max(1, last), value=first, step=1, interactive=last > 0),  # needs max > min
        step_detail_html(trace, first) if trace.steps else "",
        figures.step_probabilities(trace, first) if trace.steps else None,
        trace_file(trace),
        trace,
    )


def build_explore(registry: Registry, default_model: str) -> gr.Blocks:
    model_choices = [(e.label, e.id) for e in registry.models.values()]
    examples = example_traces()
    look = open_example(FIRST_LOOK, examples) if FIRST_LOOK in examples else None
    start = starting_values(registry, default_model, look.trace if look else None)
    with gr.Blocks() as tab:
        trace_state = gr.State(None)
        baselines = gr.State({})  # baseline key → autoregressive tokens/s, per user
        with gr.Row():
            with gr.Column(scale=1, min_width=280):
                model = gr.Dropdown(model_choices, value=start["model"], label="Model (target)", elem_id="mv-model")
                strategy = gr.Dropdown(
                    list(STRATEGIES), value=start["strategy"], label="Strategy", elem_id="mv-strategy"
                )
                draft = gr.Dropdown(
                    [("(none)", "")] + model_choices,
                    value=start["draft"],
                    label="Draft model",
                    visible=start["strategy"] in NEEDS_DRAFT,
                )
                # setting name → control, shown per strategy
                settings = controls.build_controls(start["strategy"], start["settings"])
                max_new = gr.Slider(
                    1,
                    UI_MAX_NEW_TOKENS,
                    value=start["max_new_tokens"],
                    step=1,
                    label=f"Max new tokens (limit {UI_MAX_NEW_TOKENS})",
                )
                temperature = gr.Slider(
                    0.0, 2.0, value=start["temperature"], step=0.05, label="Temperature (0 = greedy)"
                )
                top_k = gr.Number(start["top_k"], precision=0, minimum=0, label="Top-k (0 = off)")
                top_p = gr.Slider(0.01, 1.0, value=start["top_p"], step=0.01, label="Top-p (1 = off)")
                seed = gr.Number(start["seed"], precision=0, minimum=0, label="Seed")
                raw = gr.Checkbox(start["raw"], label="Raw prompt (no chat template)")
                weights = gr.Radio(
                    list(WEIGHT_CHOICES),
                    value=start["weights"],
                    label="Weights",
                    info="auto: the fastest format here that agrees with fp32 on ≥ 99% of greedy tokens "
                    "(measured once); q4 keeps the shipped GGUF's 4-bit codes",
                    elem_id="mv-weights",
                )
                with_baseline = gr.Checkbox(
                    True,
                    label="Measure autoregressive too (same prompt and settings), for the speedup",
                    elem_id="mv-with-baseline",
                )
                engine = gr.Radio(
                    [("mtp-viz (every detail)", BACKEND_OURS), ("vLLM server (kept between runs)", BACKEND_VLLM)],
                    value=BACKEND_OURS,
                    label="Engine",
                    elem_id="mv-engine",
                )
                with gr.Accordion("What runs on vLLM, and what cannot", open=False):
                    gr.Markdown(vllm_note(), elem_id="mv-vllm-note")
            with gr.Column(scale=3):
                prompt = gr.Textbox(
                    label=f"Prompt (up to {MAX_PROMPT_CHARS:,} characters)",
                    lines=5,
                    value=start["prompt"],
                    elem_id="mv-prompt",
                )
                gr.Examples(example_prompts(), [prompt], label="Spec-Bench examples (Apache-2.0)")
                with gr.Row():
                    go = gr.Button("Run", variant="primary")
                    stop = gr.Button("Stop", variant="stop")
                first_look = gr.HTML(elem_id="mv-first-look")
                summary = gr.HTML(elem_id="mv-summary")
                tokens = gr.HTML(elem_id="mv-token-view")
                gr.Markdown(notes.TOKENS)
        timeline = gr.Plot(label="Step timeline")
        gr.Markdown(notes.TIMELINE)
        with gr.Row():
            positions = gr.Plot(label="Acceptance by position")
            lengths = gr.Plot(label="Tokens per forward")
        gr.Markdown(notes.ACCEPTANCE)
        gr.Markdown("### Step-through replay")
        with gr.Row():
            prev_btn = gr.Button("◀ prev", size="sm")
            step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", interactive=False, elem_id="mv-step-slider")
            next_btn = gr.Button("next ▶", size="sm")
        with gr.Row():
            detail = gr.HTML()
            pq = gr.Plot(label="p and q")
        phase = gr.Radio(
            list(PHASES), value=PHASES[0], label="Walk through this step (for teaching)", elem_id="mv-phase"
        )
        walk = gr.HTML(elem_id="mv-walk")
        gr.Markdown(notes.REPLAY)
        with gr.Row():
            download = gr.File(label="Download this run's trace (JSON)", interactive=False)
            example = gr.Dropdown(list(examples), value=None, label="…or open an example trace")
            upload = gr.File(
                label=f"Open a trace (JSON, ≤ {MAX_TRACE_BYTES // 2**20} MB)",
                file_types=[".json"],
                type="filepath",
            )

        outputs = [tokens, summary, timeline, positions, lengths, step_slider, detail, pq, download, trace_state]
        # The inputs of a run, in the order the explore_stream API takes them: build_request's keyword →
        # control, the run's options, then every strategy setting's control (the chosen strategy's are kept).
        request_inputs = {"prompt": prompt, "model": model, "strategy": strategy, "draft": draft}
        request_inputs |= {"max_new_tokens": max_new, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        request_inputs |= {"seed": seed, "raw": raw, "weights": weights}
        options = {"with_baseline": with_baseline, "engine": engine, "baselines": baselines}
        run_inputs = {**request_inputs, **options, **settings}
        assert len(run_inputs) == len(request_inputs) + len(options) + len(settings), "a setting named like an input"

        def status(message: str, tokens_view=None):
            """An update while a run prepares or streams: a status line (and the tokens so far)."""
            tokens_view = gr.skip() if tokens_view is None else tokens_view
            return (tokens_view, f"<i>{html.escape(message)}</i>", *[gr.skip()] * 8, gr.skip())

        names = list(settings)

        def show_params(strategy_name):
            return (gr.Dropdown(visible=strategy_name in NEEDS_DRAFT), *controls.show_for(strategy_name, names))

        def pick_draft(model_id):
            entry = registry.models.get(model_id)
            return gr.Dropdown(value=(entry.drafts[0] if entry and entry.drafts else ""))

        @on_gpu
        def explore_run(*values):
            given = dict(zip(run_inputs, values, strict=True))
            with_baseline, engine, baselines = (given.pop(k) for k in options)
            try:
                request = build_request(**given)
                if engine == BACKEND_VLLM:
                    for message, trace in stream_vllm(request):
                        if trace is None:
                            yield status(message)
                    yield (*render(trace, baselines), baselines)
                    return
                yield status(
                    "preparing: loading the models, and on a model's first run with compilation on, "
                    "compiling its forward (outside the timed region)…"
                )
                key = request_baseline_key(request)
                if with_baseline and request.strategy != "autoregressive" and key not in baselines:
                    yield status("measuring autoregressive decoding first (same prompt and settings), for the speedup…")
                    base = run_to_end(as_baseline(request))
                    baselines = {**baselines, baseline_key(base): base.summary["tokens_per_s"]}
                for steps, trace in stream(request):
                    if trace is None:
                        yield status(f"decoding… step {len(steps)}", tokens_html(steps))
            except UserError as e:
                raise gr.Error(str(e)) from None
            if trace.strategy == "autoregressive":
                baselines = {**baselines, baseline_key(trace): trace.summary["tokens_per_s"]}
            yield (*render(trace, baselines), baselines)

        def replay(trace, index):
            if trace is None or not trace.steps:
                return gr.skip(), gr.skip(), gr.skip()
            i = min(max(int(index), 0), len(trace.steps) - 1)
            return (
                tokens_html(trace.steps, selected=i),
                step_detail_html(trace, i),
                figures.step_probabilities(trace, i),
            )

        def shift(trace, index, delta):
            if trace is None or not trace.steps:
                return gr.skip()
            return min(max(int(index) + delta, 0), len(trace.steps) - 1)

        def open_trace(path, baselines):
            if not path:
                return (*[gr.skip()] * 10,)
            try:
                trace = read_uploaded_trace(path)
            except UserError as e:
                raise gr.Error(str(e)) from None
            return render(trace, baselines)

        strategy.change(show_params, strategy, [draft, *settings.values()], api_visibility="private")
        model.change(pick_draft, model, draft, api_visibility="private")
        run_event = go.click(
            explore_run,
            list(run_inputs.values()),
            outputs + [baselines],
            api_name="explore_stream",  # undocumented: the streaming benchmark drives it
            api_visibility="undocumented",
            concurrency_limit=4,
        )
        run_event.then(lambda: "", None, first_look, api_visibility="private")  # the example is replaced
        stop.click(None, None, None, cancels=[run_event], api_visibility="private")
        step_slider.change(replay, [trace_state, step_slider], [tokens, detail, pq], api_visibility="private")

        def walk_through(trace, index, chosen):
            if trace is None or not trace.steps:
                return ""
            return walkthrough_html(trace.steps[min(max(int(index), 0), len(trace.steps) - 1)], chosen)

        for trigger in (step_slider, phase, trace_state):
            trigger.change(walk_through, [trace_state, step_slider, phase], walk, api_visibility="private")
        prev_btn.click(lambda t, i: shift(t, i, -1), [trace_state, step_slider], step_slider, api_visibility="private")
        next_btn.click(lambda t, i: shift(t, i, +1), [trace_state, step_slider], step_slider, api_visibility="private")
        upload.upload(open_trace, [upload, baselines], outputs, api_visibility="private")

        def show_example(name, baselines):
            """An example trace, with the speedup over the autoregressive run recorded beside it
            (kept out of the session's baselines: a run here measures its own)."""
            if not name:
                return (*[gr.skip()] * 10,)
            shown = open_example(name, examples)
            return render(shown.trace, baselines | recorded_speed(shown))

        example.change(show_example, [example, baselines], outputs, api_visibility="private")
        if look is not None:  # first paint: the recorded example, drawn from its trace (no model)

            def first_paint(baselines):
                return (note_html(look), *render(look.trace, baselines | recorded_speed(look)))

            tab.load(first_paint, baselines, [first_look, *outputs], api_visibility="private")
    return tab
