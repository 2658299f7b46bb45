"""The Benchmark tab: a `python -m mtp_viz bench` results folder (shipped examples, or an uploaded
summary.csv) as tables and plots: speedup and accepted tokens by category, speed against quality."""

import gradio as gr
import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.ui import notes
from mtp_viz.ui.opening import OnOpen
from mtp_viz.ui.results import FIRST_RESULTS, example_results, first, measured_on, read_summary
from mtp_viz.viz import figures
from mtp_viz.viz.tables import bench_table


def views(summary: pd.DataFrame, strategies: list[str] | None = None):
    """The table (every strategy) and the figures (the chosen strategies, at most MAX_SERIES)."""
    return (
        bench_table(summary),
        figures.category_bars(summary, "speedup", "Speedup over autoregressive, by category", strategies),
        figures.category_bars(summary, "mean_accepted_tokens", "Tokens per target forward, by category", strategies),
        figures.speed_quality(summary, strategies=strategies),
        figures.pareto(summary),
    )


def build_bench() -> tuple[gr.Blocks, list[OnOpen]]:
    """The tab, and what it draws when first opened (the app wires that to the tab's selection)."""
    examples = first(example_results(), FIRST_RESULTS)
    with gr.Blocks() as tab:
        gr.Markdown(notes.BENCH)
        with gr.Row():
            example = gr.Dropdown(
                list(examples), value=next(iter(examples), None), label="Results measured here (assets/bench)"
            )
            upload = gr.File(label="…or upload a summary.csv", file_types=[".csv"], type="filepath")
        where = gr.Markdown(elem_id="mv-bench-machine")
        table = gr.Dataframe(label="Every strategy, fastest first (speedup = tokens/s over autoregressive)")
        chosen = gr.CheckboxGroup(
            [],
            label=f"Strategies in the figures (at most {figures.MAX_SERIES}; default: the best variant of each)",
            elem_id="mv-bench-strategies",
        )
        speed = gr.Plot(label="Speedup by category")
        accepted = gr.Plot(label="Accepted tokens by category")
        pareto = gr.Plot(label="Speed against quality")
        lossy = gr.Plot(label="The lossy trade-off: every ConfAdapt variant, and the paper's points")
        current = gr.State("")

        def show(path):
            if not path:
                return (gr.skip(),) * 8
            try:
                summary = read_summary(path)
            except UserError as e:
                raise gr.Error(str(e)) from None
            labels = [s for s in dict.fromkeys(summary["strategy"]) if s != "autoregressive"]
            best = figures.best_variants(summary)
            return (str(path), measured_on(path), gr.CheckboxGroup(choices=labels, value=best), *views(summary, best))

        def redraw(path, strategies):
            if not path:
                return (gr.skip(),) * 3
            if len(strategies) > figures.MAX_SERIES:
                gr.Warning(f"the figures show the first {figures.MAX_SERIES} chosen strategies")
            return views(read_summary(path), strategies[: figures.MAX_SERIES])[1:4]

        outputs = [current, where, chosen, table, speed, accepted, pareto, lossy]

        def show_example(name):
            return show(examples.get(name))

        example.change(show_example, example, outputs, api_visibility="private")
        upload.upload(show, upload, outputs, api_visibility="private")
        chosen.input(redraw, [current, chosen], [speed, accepted, pareto], api_visibility="private")
    return tab, [OnOpen(show_example, [example], outputs)]
