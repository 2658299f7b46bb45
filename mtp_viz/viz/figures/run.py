"""One run's trace → figures: where each step's time went, acceptance by draft position, tokens
per target forward, and one step's p and q."""

import html

import plotly.graph_objects as go

from mtp_viz.trace import Trace, engine_label, timed
from mtp_viz.viz.figures.common import LAYOUT, empty_note
from mtp_viz.viz.style import (
    DRAFT_TIME_COLOUR,
    OTHER_TIME_COLOUR,
    P_COLOUR,
    Q_COLOUR,
    VERDICT_COLOURS,
    VERIFY_TIME_COLOUR,
)


def not_reported(trace: Trace) -> str:
    """Why a field of a trace is empty: the engine that ran it does not report it, or it was not recorded."""
    engine = engine_label(trace)
    return f"not reported by {engine}" if engine != "mtp-viz" else "not recorded in this trace"


def _step_label(step) -> str:
    return html.escape("".join(t.text for t in step.emitted))[:80]


def step_timeline(trace: Trace) -> go.Figure:
    """Per step: milliseconds drafting / verifying / other (bars), tokens drafted and emitted (lines)."""
    steps = trace.steps
    x = [s.index for s in steps]
    texts = [_step_label(s) for s in steps]
    fig = go.Figure()
    bars = ()
    if timed(steps):
        bars = (
            ("drafting", [s.draft_s * 1e3 for s in steps], DRAFT_TIME_COLOUR),
            ("verifying (target forward)", [s.verify_s * 1e3 for s in steps], VERIFY_TIME_COLOUR),
            ("other", [max(0.0, s.step_s - s.draft_s - s.verify_s) * 1e3 for s in steps], OTHER_TIME_COLOUR),
        )
    else:  # a serving engine reports per-request times only: say so, draw no zeros
        empty_note(fig, f"Per-step timings: {not_reported(trace)} (only the whole request's)")
    for name, values, colour in bars:
        fig.add_bar(
            x=x,
            y=values,
            name=name,
            marker_color=colour,
            customdata=texts,
            hovertemplate="step %{x}: %{y:.1f} ms<br>tokens: %{customdata}<extra>" + name + "</extra>",
        )
    counts = (
        ("tokens drafted", [len(s.drafted) for s in steps], dict(color="#6b7280", dash="dot")),
        ("tokens emitted", [len(s.emitted) for s in steps], dict(color="#16a34a")),
    )
    for name, values, line in counts:
        fig.add_scatter(x=x, y=values, name=name, yaxis="y2", mode="lines+markers", line=line)
    fig.update_layout(
        **LAYOUT,
        barmode="stack",
        title="Where each step's time went",
        xaxis_title="step",
        yaxis_title="ms",
        yaxis2=dict(title="tokens", overlaying="y", side="right", rangemode="tozero"),
    )
    return fig


def position_acceptance(trace: Trace) -> go.Figure:
    """Acceptance rate of the i-th drafted token (of steps that drafted at least i+1)."""
    rates = trace.summary["per_position_acceptance"]
    fig = go.Figure(
        go.Bar(
            x=list(range(1, len(rates) + 1)),
            y=rates,
            marker_color=VERDICT_COLOURS["accepted"],
            hovertemplate="draft position %{x}: %{y:.0%} accepted<extra></extra>",
        )
    )
    fig.update_layout(
        **LAYOUT,
        title="Acceptance by draft position",
        xaxis_title="draft position",
        yaxis=dict(title="accepted", range=[0, 1], tickformat=".0%"),
    )
    return fig


def accepted_length_histogram(trace: Trace) -> go.Figure:
    """How many tokens each target forward produced (accepted drafts + the target's own token)."""
    lengths = [len(s.emitted) for s in trace.steps]
    top = max(lengths, default=1)
    counts = [lengths.count(n) for n in range(1, top + 1)]
    fig = go.Figure(
        go.Bar(
            x=list(range(1, top + 1)),
            y=counts,
            marker_color="#93c5fd",
            hovertemplate="%{y} steps emitted %{x} tokens<extra></extra>",
        )
    )
    fig.update_layout(
        **LAYOUT,
        title="Tokens per target forward",
        xaxis_title="tokens emitted in the step",
        yaxis_title="steps",
        xaxis=dict(dtick=1),
    )
    return fig


def step_probabilities(trace: Trace, index: int) -> go.Figure:
    """One step's drafted tokens: draft probability q beside target probability p, by verdict."""
    step = trace.steps[index]
    labels = [f"{i + 1}: {html.escape(repr(d.text))}" for i, d in enumerate(step.drafted)]
    fig = go.Figure()
    if step.drafted and all(d.q is None for d in step.drafted) and all(p is None for p in step.target_p):
        return empty_note(fig, f"Draft and target probabilities: {not_reported(trace)}")
    if step.drafted:
        fig.add_bar(x=labels, y=[d.q for d in step.drafted], name="q (draft)", marker_color=Q_COLOUR)
        fig.add_bar(
            x=labels,
            y=step.target_p,
            name="p (target)",
            marker_color=P_COLOUR,
            marker_line=dict(color=[VERDICT_COLOURS[v] for v in step.verdicts], width=4),
        )
        fig.update_layout(barmode="group")
    fig.update_layout(
        **LAYOUT, title=f"Step {index}: p and q of each drafted token", yaxis=dict(title="probability", range=[0, 1])
    )
    return fig
