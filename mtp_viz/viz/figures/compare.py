"""Figures of a comparison: strategies' speedups side by side, and the first sampled token of
autoregressive sampling beside a strategy's (the distribution check)."""

import html
from collections import Counter

import plotly.graph_objects as go

from mtp_viz.viz.figures.common import LAYOUT


def speedup_bars(names: list[str], speedups: list[float]) -> go.Figure:
    fig = go.Figure(
        go.Bar(
            x=names,
            y=speedups,
            marker_color=["#9ca3af" if s <= 1 else "#22c55e" for s in speedups],
            text=[f"{s:.2f}x" for s in speedups],
            textposition="outside",
        )
    )
    fig.add_hline(y=1.0, line_dash="dot", line_color="#6b7280")
    fig.update_layout(**LAYOUT, title="Speedup over autoregressive (tokens/s ratio)", yaxis_title="x")
    return fig


def distribution_histogram(samples: dict[str, list[list[int]]], decode, top: int = 15) -> go.Figure:
    """Histograms of the first sampled token per sampler (autoregressive vs a strategy)."""
    counters = {name: Counter(s[0] for s in outs if s) for name, outs in samples.items()}
    total = Counter()
    for c in counters.values():
        total.update(c)
    tokens = [t for t, _ in total.most_common(top)]
    fig = go.Figure()
    for name, c in counters.items():
        n = max(1, sum(c.values()))
        fig.add_bar(x=[html.escape(repr(decode(t))) for t in tokens], y=[c[t] / n for t in tokens], name=name)
    fig.update_layout(**LAYOUT, barmode="group", title="First sampled token", yaxis_title="share of samples")
    return fig
