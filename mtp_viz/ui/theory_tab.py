"""The Theory tab: Leviathan et al.'s predicted speedup for α, γ, c (sliders), the same with this
device's measured verify-cost curve, and the measured points of the user's own runs."""

import html
from pathlib import Path

import gradio as gr

from mtp_viz.errors import UserError
from mtp_viz.kernel_plan import machine_records
from mtp_viz.linear_plan import BY_COMMAND, describe_record
from mtp_viz.profile import read_profile
from mtp_viz.theory import expected_tokens, measured_point, optimal_gamma, speedup
from mtp_viz.ui import notes
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.ui.measure import machine_profile_path, measure_machine, remeasure_linear_plan
from mtp_viz.ui.opening import OnOpen
from mtp_viz.ui.results import FIRST_PROFILE, example_traces, first, shipped_profiles
from mtp_viz.ui.trace_files import read_uploaded_trace
from mtp_viz.viz import figures

MAX_GAMMA = 16


def points_from(paths: list[str]) -> list[dict]:
    """Measured points of uploaded traces, each against the autoregressive trace of its prompt."""
    traces = [read_uploaded_trace(p) for p in paths]
    baselines = {tuple(t.prompt_token_ids): t for t in traces if t.strategy == "autoregressive"}
    points = []
    for t in traces:
        point = measured_point(t, baselines.get(tuple(t.prompt_token_ids)))
        if point is not None:
            points.append(point)
    return points


def numbers_html(alpha: float, gamma: int, c: float, verify_cost, label: str = "this device") -> str:
    tokens = expected_tokens(alpha, gamma)
    lines = [
        f"expected tokens per target forward: <b>{tokens:.2f}</b>",
        f"textbook speedup: <b>{speedup(alpha, gamma, c):.2f}x</b> (best γ = {optimal_gamma(alpha, c, MAX_GAMMA)})",
    ]
    if verify_cost and gamma + 1 in verify_cost:
        measured = speedup(alpha, gamma, c, verify_cost)
        best = optimal_gamma(alpha, c, min(MAX_GAMMA, max(verify_cost) - 1), verify_cost)
        lines.append(
            f"with the verify cost measured on {html.escape(label)} ({verify_cost[gamma + 1]:.2f}x a one-token "
            f"forward for {gamma + 1} tokens): <b>{measured:.2f}x</b> (best γ = {best})"
        )
    return "<br>".join(lines)


def build_theory() -> tuple[gr.Blocks, list[OnOpen]]:
    """The tab, and what it draws when first opened (the app wires that to the tab's selection)."""
    profiles = first(shipped_profiles(), FIRST_PROFILE)
    with gr.Blocks() as tab:
        gr.Markdown(notes.THEORY)
        with gr.Row():
            alpha = gr.Slider(0.0, 0.99, value=0.7, step=0.01, label="α: chance a drafted token is accepted")
            gamma = gr.Slider(1, MAX_GAMMA, value=4, step=1, label="γ: draft length")
            c = gr.Slider(0.0, 1.0, value=0.1, step=0.01, label="c: draft forward / target forward")
        numbers = gr.HTML(elem_id="mv-theory-numbers")
        plot = gr.Plot(label="Predicted speedup")
        with gr.Row():
            profile = gr.Dropdown(
                [("(none)", "")] + [(k, str(v)) for k, v in profiles.items()],
                value=str(next(iter(profiles.values()), "")),
                label="Shipped verify-cost curve (python -m mtp_viz profile)",
            )
            profile_upload = gr.File(label="…or upload a profile JSON", file_types=[".json"], type="filepath")
            traces = gr.File(
                label="Your runs' traces (with the autoregressive run of the same prompt)",
                file_count="multiple",
                file_types=[".json"],
                type="filepath",
            )
        use_examples = gr.Checkbox(False, label="Show the example traces' measured points")
        with gr.Row():
            measure = gr.Button("Measure this machine", variant="secondary", elem_id="mv-measure")
            stop = gr.Button("Stop", variant="stop", elem_id="mv-measure-stop")
        cached = machine_profile_path()
        mine = gr.State(str(cached) if cached.is_file() else "")
        measured = gr.Markdown(_measured_note(mine.value), elem_id="mv-measure-status")
        gr.Markdown(notes.EXITS)
        exits_plot = gr.Plot(label="Early-exit agreement by layer")
        with gr.Accordion("Linear kernels: the plan this machine measured", open=False):
            plans = gr.Markdown(plans_note(), elem_id="mv-linear-plans")
            with gr.Row():
                retune = gr.Button("Measure the kernels again", variant="secondary", elem_id="mv-retune")
                retune_stop = gr.Button("Stop", variant="stop", elem_id="mv-retune-stop")

        def update(alpha, gamma, c, profile, uploaded_profile, paths, examples, own):
            try:
                chosen = read_profile(uploaded_profile or profile)
                yours = read_profile(own) if own else None
                files = list(paths or []) + ([str(p) for p in example_traces().values()] if examples else [])
                points = points_from(files)
            except UserError as e:
                raise gr.Error(str(e)) from None
            curves = [(f"{v.label} (this machine)" if v is yours else v.label, v.curve) for v in (yours, chosen) if v]
            first = yours or chosen
            gamma = int(gamma)
            return (
                numbers_html(alpha, gamma, c, first.curve if first else None, first.label if first else ""),
                figures.theory_curves(alpha, c, curves, points, MAX_GAMMA),
                figures.exit_agreement_bars(chosen.exits if chosen else None),
            )

        @on_gpu
        def run_measurement():
            """This machine's verify-cost curve, measured in the app (cached for later visits)."""
            try:
                for done, total, path in measure_machine():
                    if path is None:
                        yield gr.skip(), f"Measuring this machine: round {done} of {total}…"
                    else:
                        yield str(path), _measured_note(str(path))
            except UserError as e:
                raise gr.Error(str(e)) from None

        @on_gpu
        def run_retune():
            """The linear plan measured again in the app (cached, and used by the loaded model)."""
            try:
                yield from remeasure_linear_plan()
            except UserError as e:
                raise gr.Error(str(e)) from None
            yield plans_note()

        inputs = [alpha, gamma, c, profile, profile_upload, traces, use_examples, mine]
        outputs = [numbers, plot, exits_plot]
        for component in (alpha, gamma, c, profile, use_examples, mine):
            component.change(update, inputs, outputs, api_visibility="private")
        for component in (profile_upload, traces):
            component.upload(update, inputs, outputs, api_visibility="private")
        measuring = measure.click(run_measurement, None, [mine, measured], api_visibility="private")
        stop.click(lambda: "Measurement stopped.", None, measured, cancels=[measuring], api_visibility="private")
        retuning = retune.click(run_retune, None, plans, api_visibility="private")
        retune_stop.click(plans_note, None, plans, cancels=[retuning], api_visibility="private")
    return tab, [OnOpen(update, inputs, outputs), OnOpen(plans_note, [], [plans])]


def _measured_note(path: str) -> str:
    if not path:
        return "No measurement of this machine yet: **Measure this machine** times the forwards here (a few seconds)."
    view = read_profile(path)
    return (
        f"This machine's curve ({html.escape(view.label)}) is drawn beside the chosen one; measure again to refresh it."
    )


def plans_note() -> str:
    """This machine's measured linear plans (one per model shape), and how to measure them again."""
    records = machine_records()
    if not records:
        lines = ["No linear plan measured on this machine yet: a model loaded in float32 on a CPU measures one."]
    else:
        lines = [f"- **{html.escape(Path(str(r['model'])).name)}**: {html.escape(describe_record(r))}" for r in records]
    lines.append(
        "\nMeasured on a model's first load; a row count whose timings stayed noisy (another job on the CPU) "
        f"runs stock until measured again. Measure again when the machine is quiet: here, or `{BY_COMMAND} "
        "[--model M]` (`--dry-run` prints the timings without caching)."
    )
    return "\n".join(lines)
