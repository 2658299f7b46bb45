"""Runs of one prompt side by side, autoregressive first as the baseline: the requests that make
them, running them in turn, or uploaded traces checked to be comparable; then their metrics and
verdicts."""

from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd

from mtp_viz.deploy import deploy_costs
from mtp_viz.errors import UserError
from mtp_viz.quality import verdicts
from mtp_viz.runner import RunRequest
from mtp_viz.trace import Trace
from mtp_viz.ui.requests import build_request
from mtp_viz.ui.streaming import stream
from mtp_viz.ui.trace_files import read_uploaded_trace
from mtp_viz.viz.tables import metrics_table

MAX_COMPARED = 4  # runs side by side in a comparison: autoregressive + 3 others


def comparison_requests(strategies: list[str], **values) -> list[RunRequest]:
    """Autoregressive first, then the chosen strategies, all with the same prompt and settings."""
    chosen = ["autoregressive"] + [s for s in dict.fromkeys(strategies) if s != "autoregressive"]
    if len(chosen) > MAX_COMPARED:
        raise UserError(f"compare at most {MAX_COMPARED - 1} strategies beside autoregressive")
    if len(chosen) < 2:
        raise UserError("pick at least one strategy to compare with autoregressive")
    return [build_request(strategy=s, **values) for s in chosen]


@dataclass(frozen=True)
class Comparison:
    """Runs of one prompt side by side, autoregressive first: their metrics and verdicts."""

    traces: list[Trace]
    metrics: pd.DataFrame  # viz.tables.metrics_table, speedups over the first run
    verdicts: dict[str, str]  # strategy → quality.verdicts' line


def comparison(traces: list[Trace], live: bool = True) -> Comparison:
    """Live runs also get what each strategy costs to deploy (from the models they just loaded);
    uploaded traces do not, so that opening one never loads, let alone downloads, a model."""
    costs = deploy_costs(traces) if live else None
    return Comparison(traces, metrics_table(traces, baseline=traces[0], costs=costs), verdicts(traces))


def compare(strategies: list[str], **values) -> Iterator[tuple[str, list[Trace], Comparison | None]]:
    """Autoregressive, then each chosen strategy, on one prompt and settings (`values`: as
    build_request takes them): (what is running, the traces so far, None) while they run, then
    ("", all traces, their Comparison). Closing it cancels the run in flight within one step."""
    requests = comparison_requests(strategies, **values)
    traces: list[Trace] = []
    for r in requests:
        for steps, trace in stream(r):
            if trace is None:
                yield f"{r.strategy}: step {len(steps)}…", list(traces), None
        traces.append(trace)
        yield f"finished {len(traces)} of {len(requests)}…", list(traces), None
    yield "", traces, comparison(traces)


def uploaded_comparison(paths: list[str] | None) -> list[Trace]:
    """Uploaded traces, the autoregressive one first as the baseline."""
    traces = [read_uploaded_trace(p) for p in paths or []]
    if not 2 <= len(traces) <= MAX_COMPARED:
        raise UserError(f"upload 2 to {MAX_COMPARED} traces, one of them autoregressive")
    traces.sort(key=lambda t: t.strategy != "autoregressive")
    if traces[0].strategy != "autoregressive":
        raise UserError("one of the uploaded traces must be an autoregressive run: it is the baseline")
    if len({tuple(t.prompt_token_ids) for t in traces}) > 1:
        raise UserError("the uploaded traces are of different prompts; compare runs of one prompt")
    return traces
