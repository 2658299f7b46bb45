"""The Deploy? tab: per strategy, what a benchmark measured (speedup, quality) beside what it costs
to deploy (extra models, parameters, memory, training, forwards per token, from the loaded
objects), and whether the speedup survives load (predicted from this device's B × k timings).

Pricing loads the target and each strategy's drafter, so nothing here runs on page load: the tab
draws when a user first opens it, and a results file is priced once per process (per its path,
modification time and the quality floor)."""

import json
from functools import lru_cache
from pathlib import Path

import gradio as gr
import pandas as pd

from mtp_viz.deploy import (
    DEFAULT_QUALITY_FLOOR,
    DEPLOY_CONTEXT,
    LOSSLESS,
    QUALITY,
    concurrency_curves,
    deploy_table,
    quality_class,
    within_floor,
)
from mtp_viz.errors import UserError
from mtp_viz.labels import is_peer
from mtp_viz.machine import machine_label
from mtp_viz.profile import read_batch_profile, read_profile
from mtp_viz.schedule import Recommendation, crossover, to_vllm
from mtp_viz.served_costs import NOT_MODELLED, TERMS
from mtp_viz.serving.prediction import with_prediction
from mtp_viz.serving.scheduled import auto_schedule, family, longest_fixed
from mtp_viz.serving.sweep import BASELINE, read_sweep
from mtp_viz.theory import CONCURRENCY_ASSUMPTIONS
from mtp_viz.ui import notes
from mtp_viz.ui.gpu import on_gpu
from mtp_viz.ui.measure import machine_profile_path
from mtp_viz.ui.opening import OnOpen
from mtp_viz.ui.readable import readable
from mtp_viz.ui.results import (
    FIRST_RESULTS,
    example_results,
    first,
    measured_on,
    read_summary,
    results_model,
    serving_sweeps,
    shipped_profiles,
)
from mtp_viz.ui.temp_files import download_file
from mtp_viz.viz import figures
from mtp_viz.viz.crossover import example_row, worked_example

PREFILL_NOTE = ", the prompts' prefill added to both sides at the engine's cost of a token"
THIS_MACHINE = "this machine (measured in the Theory tab)"
FIRST_SWEEP = "cpu-avx2-smollm2-135m-vllm-served"  # the sweep the serving section opens on (its profile first)
LOSSY_RESULTS = "cpu-smollm2-135m-mask"  # ConfAdapt's τ sweep and fixed k: the lossy table opens on it
SCHEDULE_NOTE = """**Which draft length at which load?** From the chosen step costs and the acceptance each
speculative strategy measured at its longest fixed length, the draft length per number of concurrent
sequences that maximises predicted throughput (0: off), as the table vLLM 0.32 takes in its
speculative config (`num_speculative_tokens_per_batch_size`: batch from, batch to, draft tokens;
past the last range vLLM keeps the last length), and the load from which plain serving (no speculative
config) is recommended instead: a 0 in the table still runs vLLM's speculative path. `bench --backend vllm
--schedule auto` serves it and measures it beside every fixed length and plain decoding (the `per_batch=`
rows above), and the recommended configuration as its own rows (`:recommended`)."""


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
SERVING_COLUMNS += ["ttft_s", "itl_s", "served_as"]


def serving_views(sweep: Path | None, profile: Path | None):
    """(figure, table, schedules, caption) of a serving sweep: measured speedup per concurrency
    beside our load model's prediction from the chosen profile, the difference, and the schedule
    the profile recommends for each speculative strategy from the acceptance measured in the sweep."""
    if sweep is None:
        empty = figures.serving_curves(pd.DataFrame(columns=SERVING_COLUMNS), "no sweep")
        return empty, pd.DataFrame(), pd.DataFrame(), ""
    table, meta = read_sweep(sweep)
    view = read_profile(profile)
    batch, c = (view.batch_cost, view.draft_costs()) if view else (None, None)
    prefill = view.prefill() if view else None
    table = with_prediction(table, batch, c, prefill, view.served if view else None)
    machine = f"{machine_label(meta.get('machine', {}))}, vLLM {meta.get('vllm') or 'version not recorded'}"
    engine = view is not None and view.engine != "mtp-viz"
    served = view is not None and view.served is not None
    costs = (
        f"vLLM's costs as served ({view.label}: `profile --backend vllm`): each request's decode steps times "
        "its server's step and its round of prefills, on each side"
        if served
        else f"the step costs vLLM itself measured ({view.label}: `profile --backend vllm`), its drafters' cost per B"
        if engine
        else f"B × k timings of our engine on {view.label if view else 'no profile'}, the draft's c "
        + ("unknown" if c is None else f"{c:.3f}")
        + " (dotted: c measured on vLLM at one client, `engine_c`)"
    )
    caption = (
        f"Measured with {len(meta.get('prompts', []))} Spec-Bench prompts per concurrency level on {machine} "
        f"(`python -m mtp_viz bench --backend vllm`); predicted (dashed) from {costs}, and each strategy's "
        "tokens per step as vLLM measured them"
        + (
            ", the prompts' prefill added to both sides at the engine's cost of a token"
            if prefill and not served
            else ""
        )
        + ". error = (predicted − measured) / measured."
        + (f" Modelled: {'; '.join(TERMS)}. Not modelled: {'; '.join(NOT_MODELLED)}." if served else "")
    )
    shown = table[[c for c in SERVING_COLUMNS if c in table]]
    recs = recommendations(table, view)
    plain_from = {s: rec.plain_from for s, (_, rec) in recs.items() if rec.plain_from is not None}
    told = example_row(table)
    example = worked_example(
        view, table, recs.get(family(told["strategy"]), (None, None))[1] if told is not None else None
    )
    figure = figures.serving_curves(table, machine, plain_from)
    return figure, shown, schedules_view(table, meta, view), caption + ("\n\n" + example if example else "")


SCHEDULE_COLUMNS = ["strategy", "acceptance from", "num_speculative_tokens_per_batch_size"]
SCHEDULE_COLUMNS += ["speculation stops paying from B", "plain serving from B", "served in this sweep as"]


def recommendations(table: pd.DataFrame, view) -> dict[str, tuple[str, Recommendation]]:
    """Per speculative strategy of a sweep: the fixed label its acceptance comes from (its longest)
    and the configuration the profile recommends from it."""
    found_all = {}
    for strategy in dict.fromkeys(family(label) for label in table["strategy"]):
        found = longest_fixed(table, strategy) if strategy != BASELINE else None
        if found is None or view is None or not view.batch_cost:
            continue
        try:
            found_all[strategy] = (
                found[0],
                auto_schedule(table, view, found[0], found[1], int(table["concurrency"].max())),
            )
        except UserError:
            continue  # no acceptance measured, or no drafter cost in this profile
    return found_all


def schedules_view(table: pd.DataFrame, meta: dict, view) -> pd.DataFrame:
    """Per speculative strategy of a sweep: the schedule the profile recommends from the acceptance
    its longest fixed variant measured (vLLM's table form), where speculation stops paying, from
    which load plain serving is recommended, and the label it was served under in this sweep."""
    rows = []
    served = {
        tuple(map(tuple, s["num_speculative_tokens_per_batch_size"])): label
        for label, s in meta.get("schedules", {}).items()
    }
    for strategy, (source, rec) in recommendations(table, view).items():
        stop, plain = crossover(rec.table), rec.plain_from
        rows.append(
            {
                "strategy": strategy,
                "acceptance from": source,
                "num_speculative_tokens_per_batch_size": json.dumps(to_vllm(rec.table)),
                "speculation stops paying from B": "never (up to the last measured)" if stop is None else stop,
                "plain serving from B": "never (up to the last measured)" if plain is None else plain,
                "served in this sweep as": served.get(rec.table, "—"),
            }
        )
    return pd.DataFrame(rows, columns=SCHEDULE_COLUMNS)


PRICED_KEPT = 64  # priced tables kept per process: results files × quality floors looked at


def priced(results: Path, floor: float) -> tuple[pd.DataFrame, str]:
    """(deploy table, its CSV to download) of a results file at a quality floor, priced once per
    process for this version of the file."""
    return price_results(str(results), results.stat().st_mtime_ns, floor)


@lru_cache(maxsize=PRICED_KEPT)
@on_gpu  # the models load on the device a run would use
def price_results(results: str, mtime_ns: int, floor: float) -> tuple[pd.DataFrame, str]:
    """`priced` for one version of a results file (cached; `price_results.cache_clear()` forgets)."""
    table = deploy_table(read_summary(results), results_model(results), floor=floor)
    csv = download_file(f"deploy-{Path(results).parent.name}.csv", table.to_csv(index=False))
    return table, str(csv)


def views(results: Path | None, profile: Path | None, floor: float = DEFAULT_QUALITY_FLOOR):
    """(table, CSV path, concurrency figure, caption) for a results folder and a profile; the
    table in full precision, as the CSV has it."""
    if results is None:
        return pd.DataFrame(), None, figures.concurrency({}, "no results"), "No benchmark results to show."
    table, csv = priced(results, floor)
    summary = read_summary(results)
    batch, c, machine = read_batch_profile(profile)
    ranked = within_floor(summary, floor)  # a fast variant with garbage output heads no figure
    chosen = [s for s in figures.best_variants(ranked) if not is_peer(s)]
    curves = concurrency_curves(summary, chosen, batch, c) if batch else {}
    caption = f"Speed and quality: {measured_on(results)} Load curve: B × k timings measured on {machine}. " + (
        "" if batch else "This profile has no B × k timings: `python -m mtp_viz profile` measures them."
    )
    return table, csv, figures.concurrency(curves, machine), caption


def lossy_under_load(results: Path | None, profile: Path | None) -> pd.DataFrame:
    """Every unverified (lossy) variant of a results folder, whatever its quality: the speedup our
    load model predicts for it per number of users from the profile, beside its quality, so a
    speedup that collapses under load reads off next to what its text is worth."""
    if results is None:
        return pd.DataFrame()
    summary = read_summary(results)
    batch, c, _ = read_batch_profile(profile)
    overall = summary[(summary["category"] == "overall") & ~summary["strategy"].map(is_peer)].set_index("strategy")
    lossy = [str(s) for s, row in overall.iterrows() if quality_class(str(s), row, 0.0) != LOSSLESS]
    curves = concurrency_curves(summary, lossy, batch, c) if batch else {}
    rows = []
    for label, (speedups, below) in curves.items():
        row = overall.loc[label]
        rows.append(
            {"strategy": label, "agreement with autoregressive": row.get(QUALITY), "measured speedup": row["speedup"]}
            | {f"predicted, {b} users": v for b, v in speedups.items()}
            | {"below 1x from": below if below else "—"}
        )
    return pd.DataFrame(rows)


def serving_profiles(found: dict[str, Path]) -> dict[str, Path]:
    """Profiles for the serving section: those measured on a serving engine first (its own costs),
    those with its costs as served before the lockstep ones."""

    def order(item: tuple[str, Path]) -> tuple[bool, bool]:
        view = read_profile(item[1])
        return view.engine == "mtp-viz", view.served is None

    return dict(sorted(found.items(), key=order))


def with_load_figures(examples: dict[str, Path]) -> dict[str, Path]:
    """Results that have the per-forward figures the load curve needs first (older ones lack them)."""
    has = {
        name: "scored_per_forward" in path.read_text(encoding="utf-8").split("\n", 1)[0]
        for name, path in examples.items()
    }
    return dict(sorted(examples.items(), key=lambda item: not has[item[0]]))


def deploy_results() -> dict[str, Path]:
    """The shipped results the tab lists: those with load figures first, and first of all the run
    the Benchmark tab opens too (the default engine with every shipped drafter)."""
    return first(with_load_figures(example_results()), FIRST_RESULTS)


def build_deploy() -> tuple[gr.Blocks, list[OnOpen]]:
    """The tab, and what it draws when first opened (the app wires that to the tab's selection)."""
    examples = deploy_results()
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
        lossy_examples = first(examples, LOSSY_RESULTS)
        lossy_results = gr.Dropdown(
            list(lossy_examples), value=next(iter(lossy_examples), None), label="Unverified strategies from"
        )
        lossy = gr.Dataframe(
            label="Unverified (lossy) strategies under load: predicted speedup per number of users, beside "
            "their quality (every lossy variant, whatever the floor)",
            elem_id="mv-deploy-lossy",
        )
        gr.Markdown(notes.SERVING)
        sweeps = first(serving_sweeps(), FIRST_SWEEP)
        engine_profiles = serving_profiles(shipped)
        with gr.Row():
            sweep = gr.Dropdown(
                list(sweeps), value=next(iter(sweeps), None), label="Measured on a serving engine (vLLM)"
            )
            serving_profile = gr.Dropdown(
                list(engine_profiles),
                value=next(iter(engine_profiles), None),
                label="Step costs for the prediction (a profile; the engine's own first)",
            )
        serving_caption = gr.Markdown(elem_id="mv-serving-caption")
        serving_curve = gr.Plot(label="Measured under load", elem_id="mv-serving-load")
        serving_table = gr.Dataframe(label="Measured beside predicted, per concurrency", elem_id="mv-serving-table")
        gr.Markdown(SCHEDULE_NOTE)
        schedules = gr.Dataframe(label="Recommended schedule, as vLLM takes it", elem_id="mv-serving-schedule")

        def show(name, profile_name, quality_floor):
            try:
                t, path, fig, text = views(examples.get(name), shipped.get(profile_name), quality_floor)
            except UserError as e:
                raise gr.Error(str(e)) from None
            return readable(t), gr.DownloadButton(value=path), fig, text

        def show_lossy(name, profile_name):
            try:
                return readable(lossy_under_load(lossy_examples.get(name), shipped.get(profile_name)))
            except UserError as e:
                raise gr.Error(str(e)) from None

        def show_serving(name, profile_name):
            try:
                fig, shown, recommended, text = serving_views(sweeps.get(name), engine_profiles.get(profile_name))
            except UserError as e:
                raise gr.Error(str(e)) from None
            return fig, readable(shown), recommended, text

        outputs = [table, csv, curve, caption]
        serving_outputs = [serving_curve, serving_table, schedules, serving_caption]
        for trigger in (results, profile, floor):
            trigger.change(show, [results, profile, floor], outputs, api_visibility="private")
        for trigger in (sweep, serving_profile):
            trigger.change(show_serving, [sweep, serving_profile], serving_outputs, api_visibility="private")
        for trigger in (lossy_results, profile):
            trigger.change(show_lossy, [lossy_results, profile], lossy, api_visibility="private")
    opened = [
        OnOpen(show, [results, profile, floor], outputs),
        OnOpen(show_lossy, [lossy_results, profile], [lossy]),
        OnOpen(show_serving, [sweep, serving_profile], serving_outputs),
    ]
    return tab, opened
