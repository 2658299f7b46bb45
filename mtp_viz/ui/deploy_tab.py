"""The Deploy? tab: per strategy, what a benchmark measured (speedup, quality) beside what it costs
to deploy (extra models, parameters, memory, training, forwards per token, from the loaded
objects), and whether the speedup survives load (predicted from this device's B × k timings)."""

import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd

from mtp_viz.deploy import DEPLOY_CONTEXT, concurrency_curves, deploy_table
from mtp_viz.errors import UserError
from mtp_viz.profile import read_batch_profile
from mtp_viz.theory import CONCURRENCY_ASSUMPTIONS
from mtp_viz.ui import notes, service
from mtp_viz.ui.bench_tab import example_results, measured_on, read_summary, results_model
from mtp_viz.ui.theory_tab import shipped_profiles
from mtp_viz.viz import figures

THIS_MACHINE = "this machine (measured in the Theory tab)"


def profiles() -> dict[str, Path]:
    """Profiles with B × k timings: the shipped ones, and this machine's once measured."""
    found = dict(shipped_profiles())
    mine = service.machine_profile_path()
    if mine.is_file():
        found[THIS_MACHINE] = mine
    return found


def views(results: Path | None, profile: Path | None):
    """(table, CSV path, concurrency figure, caption) for a results folder and a profile."""
    if results is None:
        return pd.DataFrame(), None, figures.concurrency({}, "no results"), "No benchmark results to show."
    summary = read_summary(results)
    table = deploy_table(summary, results_model(results))
    csv = Path(tempfile.mkdtemp(prefix="mtp-viz-deploy-")) / f"deploy-{results.parent.name}.csv"
    table.to_csv(csv, index=False)
    batch, c, machine = read_batch_profile(profile)
    chosen = [s for s in figures.best_variants(summary) if not s.startswith(figures.PEER_PREFIX)]
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

        def show(name, profile_name):
            try:
                t, path, fig, text = views(examples.get(name), profiles().get(profile_name))
            except UserError as e:
                raise gr.Error(str(e)) from None
            return t, gr.DownloadButton(value=path), fig, text

        outputs = [table, csv, curve, caption]
        results.change(show, [results, profile], outputs, api_visibility="private")
        profile.change(show, [results, profile], outputs, api_visibility="private")
        tab.load(show, [results, profile], outputs, api_visibility="private")
    return tab
