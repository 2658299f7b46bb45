"""The Benchmark tab: a `python -m mtp_viz bench` results folder (shipped examples, or an uploaded
summary.csv) as tables and plots: speedup and accepted tokens by category, speed against quality."""

import json
from pathlib import Path

import gradio as gr
import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.machine import describe
from mtp_viz.registry import load_registry
from mtp_viz.ui import notes, service
from mtp_viz.viz import figures
from mtp_viz.viz.tables import bench_table

EXAMPLE_RESULTS = Path(__file__).resolve().parent.parent.parent / "assets" / "bench"
REQUIRED = ("category", "strategy", "tokens_per_s", "speedup", "mean_accepted_tokens", "agreement")


def example_results() -> dict[str, Path]:
    return {p.parent.name: p for p in sorted(EXAMPLE_RESULTS.glob("*/summary.csv"))}


def read_summary(path: str | Path) -> pd.DataFrame:
    if Path(path).stat().st_size > service.MAX_TRACE_BYTES:
        raise UserError("that file is too large for a bench summary")
    try:
        summary = pd.read_csv(path)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError):
        raise UserError("not a CSV file: upload the summary.csv that `python -m mtp_viz bench` writes") from None
    missing = [c for c in REQUIRED if c not in summary.columns]
    if missing:
        raise UserError(f"not a bench summary: columns {', '.join(missing)} are missing")
    return summary


def measured_on(path: str | Path) -> str:
    """Which machine a results folder was measured on (its summary.json), for the tab's caption."""
    record = Path(path).with_name("summary.json")
    try:
        machine = json.loads(record.read_text(encoding="utf-8")).get("machine") or {}
    except (OSError, ValueError, AttributeError):
        machine = {}
    return f"Measured on {describe(machine)}." if machine else "The machine these results came from is not recorded."


def results_model(path: str | Path) -> str:
    """The model a results folder was measured on (its summary.json; older ones: the CPU default)."""
    try:
        model = json.loads(Path(path).with_name("summary.json").read_text(encoding="utf-8")).get("model")
    except (OSError, ValueError, AttributeError):
        model = None
    return model or load_registry().default_for("cpu")


def views(summary: pd.DataFrame, strategies: list[str] | None = None):
    """The table (every strategy) and the figures (the chosen strategies, at most MAX_SERIES)."""
    return (
        bench_table(summary),
        figures.category_bars(summary, "speedup", "Speedup over autoregressive, by category", strategies),
        figures.category_bars(summary, "mean_accepted_tokens", "Tokens per target forward, by category", strategies),
        figures.speed_quality(summary, strategies=strategies),
        figures.pareto(summary),
    )


def build_bench() -> gr.Blocks:
    examples = example_results()
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
        example.change(lambda name: show(examples.get(name)), example, outputs, api_visibility="private")
        upload.upload(show, upload, outputs, api_visibility="private")
        chosen.input(redraw, [current, chosen], [speed, accepted, pareto], api_visibility="private")
        tab.load(lambda name: show(examples.get(name)), example, outputs, api_visibility="private")
    return tab
