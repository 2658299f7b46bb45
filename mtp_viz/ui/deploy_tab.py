"""The Deploy? tab: per strategy, what a benchmark measured (speedup, quality) beside what it costs
to deploy (extra models, parameters, memory, training, forwards per token, from the loaded
objects), and whether the speedup survives load (predicted from this device's B × k timings)."""

import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd

from mtp_viz.deploy import DEFAULT_QUALITY_FLOOR, DEPLOY_CONTEXT, concurrency_curves, deploy_table, within_floor
from mtp_viz.errors import UserError
from mtp_viz.labels import is_peer
from mtp_viz.machine import machine_label
from mtp_viz.profile import read_batch_profile
from mtp_viz.serving.prediction import with_prediction
from mtp_viz.serving.sweep import read_sweep
from mtp_viz.theory import CONCURRENCY_ASSUMPTIONS
from mtp_viz.ui import notes
from mtp_viz.ui.measure import machine_profile_path
from mtp_viz.ui.results import (
    example_results,
    measured_on,
    read_summary,
    results_model,
    serving_sweeps,
    shipped_profiles,
)
from mtp_viz.viz import figures

THIS_MACHINE = "this machine (measured in the Theory tab)"


def profiles() -> dict[str, Path]:
    """The shipped profiles and this machine's once measured, those with B × k timings first, so
    the tab opens on one that draws the prediction under load."""
    found = dict(shipped_profiles())
    mine = machine_profile_path()
    if mine.is_file():
        found[THIS_MACHINE] = mine
    return dict(sorted(found.items(), key=lambda item: read_batch_profile(item[1])[0] is None))


SERVING_COLUMNS = ["strategy", "concurrency", "tokens_per_s", "speedup", "predicted_speedup", "prediction_error"]
SERVING_COLUMNS += ["calibrated_speedup", "calibrated_error", "engine_c", "mean_accepted_tokens", "identical_to_ar"]
SERVING_COLUMNS += ["ttft_s", "itl_s"]


def serving_views(sweep: Path | None, profile: Path | None):
    """(figure, table, caption) of a serving sweep: measured speedup per concurrency beside our
    load model's prediction from the chosen profile, and the difference."""
    if sweep is None:
        return figures.serving_curves(pd.DataFrame(columns=SERVING_COLUMNS), "no sweep"), pd.DataFrame(), ""
    table, meta = read_sweep(sweep)
    batch, c, profile_machine = read_batch_profile(profile)
    table = with_prediction(table, batch, c)
    machine = f"{machine_label(meta.get('machine', {}))}, vLLM {meta.get('vllm', '?')}"
    caption = (
        f"Measured with {len(meta.get('prompts', []))} Spec-Bench prompts per concurrency level on {machine} "
        f"(`python -m mtp_viz bench --backend vllm`); predicted from B × k timings of our engine on "
        f"{profile_machine} and each strategy's tokens per forward as vLLM measured them (dashed), and the "
        "same with the draft's cost c measured on vLLM at one client (dotted, `engine_c`; the profile's c "
        f"is {'unknown' if c is None else f'{c:.3f}'}). error = (predicted − measured) / measured."
    )
    shown = table[[c for c in SERVING_COLUMNS if c in table]].round(3)
    return figures.serving_curves(table, machine), shown, caption


def views(results: Path | None, profile: Path | None, floor: float = DEFAULT_QUALITY_FLOOR):
    """(table, CSV path, concurrency figure, caption) for a results folder and a profile."""
    if results is None:
        return pd.DataFrame(), None, figures.concurrency({}, "no results"), "No benchmark results to show."
    summary = read_summary(results)
    table = deploy_table(summary, results_model(results), floor=floor)
    csv = Path(tempfile.mkdtemp(prefix="mtp-viz-deploy-")) / f"deploy-{results.parent.name}.csv"
    table.to_csv(csv, index=False)
    batch, c, machine = read_batch_profile(profile)
    ranked = within_floor(summary, floor)  # a fast variant with garbage output heads no figure
    chosen = [s for s in figures.best_variants(ranked) if not is_peer(s)]
    curves = concurrency_curves(summary, chosen, batch, c) if batch else {}
    caption = f"Speed and quality: {measured_on(results)} Load curve: B × k timings measured on {machine}. " + (
        "" if batch else "This profile has no B × k timings: `python -m mtp_viz profile` measures them."
    )
    return table, str(csv), figures.concurrency(curves, machine), caption


def with_load_figures(examples: dict[str, Path]) -> dict[str, Path]:
    """Results that have the per-forward figures the load curve needs first (older ones lack them)."""
    has = {
        name: "scored_per_forward" in path.read_text(encoding="utf-8").split("\n", 1)[0]
        for name, path in examples.items()
    }
    return dict(sorted(examples.items(), key=lambda item: not has[item[0]]))


def build_deploy() -> gr.Blocks:
    examples = with_load_figures(example_results())
    shipped = profiles()
    with gr.Blocks() as tab:
        gr.Markdown(notes.DEPLOY)
        with gr.Row():
            results = gr.Dropdown(list(examples), value=next(iter(examples), None), label="Benchmark results")
            profile = gr.Dropdown(list(shipped), value=next(iter(shipped), None), label="B × k timings (profile)")
            floor = gr.Slider(
                0.0,
                1.0,
                value=DEFAULT_QUALITY_FLOOR,
                step=0.05,
                label="Quality floor for lossy strategies (token agreement with autoregressive)",
                info="Lossy variants below it are listed last, marked, and left out of the load curve.",
                elem_id="mv-deploy-floor",
            )
        caption = gr.Markdown(elem_id="mv-deploy-caption")
        table = gr.Dataframe(
            label="Per strategy: measured speed and quality beside what it costs to deploy "
            f"(memory: extra weights plus a draft's KV cache at {DEPLOY_CONTEXT:,} tokens)",
            elem_id="mv-deploy-table",
        )
        csv = gr.DownloadButton("Download the table (CSV)", elem_id="mv-deploy-csv")
        gr.Markdown(
            f"**Does it survive load? Assumptions:** {CONCURRENCY_ASSUMPTIONS}", elem_id="mv-deploy-assumptions"
        )
        curve = gr.Plot(label="Does it survive load?", elem_id="mv-deploy-load")
        gr.Markdown(notes.SERVING)
        sweeps = serving_sweeps()
        sweep = gr.Dropdown(list(sweeps), value=next(iter(sweeps), None), label="Measured on a serving engine (vLLM)")
        serving_caption = gr.Markdown(elem_id="mv-serving-caption")
        serving_curve = gr.Plot(label="Measured under load", elem_id="mv-serving-load")
        serving_table = gr.Dataframe(label="Measured beside predicted, per concurrency", elem_id="mv-serving-table")

        def show(name, profile_name, quality_floor):
            try:
                t, path, fig, text = views(examples.get(name), profiles().get(profile_name), quality_floor)
            except UserError as e:
                raise gr.Error(str(e)) from None
            return t, gr.DownloadButton(value=path), fig, text

        def show_serving(name, profile_name):
            try:
                return serving_views(sweeps.get(name), profiles().get(profile_name))
            except UserError as e:
                raise gr.Error(str(e)) from None

        outputs = [table, csv, curve, caption]
        serving_outputs = [serving_curve, serving_table, serving_caption]
        for trigger in (results, profile, floor):
            trigger.change(show, [results, profile, floor], outputs, api_visibility="private")
        for trigger in (sweep, profile):
            trigger.change(show_serving, [sweep, profile], serving_outputs, api_visibility="private")
        tab.load(show, [results, profile, floor], outputs, api_visibility="private")
        tab.load(show_serving, [sweep, profile], serving_outputs, api_visibility="private")
    return tab
