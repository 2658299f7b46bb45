"""Speed under load → figures: the speedup our load model predicts per number of concurrent users,
and the one measured on a serving engine beside its prediction."""

import html
import math

import plotly.graph_objects as go

from mtp_viz.viz.figures.common import MAX_SERIES, empty_note, family, family_style, wide_layout

VARIANT_MARKERS = ("circle", "square", "diamond", "triangle-up", "cross")


def concurrency(curves: dict[str, tuple[dict[int, float], int | None]], machine: str) -> go.Figure:
    """Predicted speedup against concurrent users per strategy (mtp_viz.deploy.concurrency_curves),
    a cross where each first drops below 1x; labelled with the machine the B × k timings came from."""
    fig = go.Figure()
    for label, (speedups, below) in list(curves.items())[:MAX_SERIES]:
        colour, marker = family_style(label)
        name = html.escape(label + (f" (below 1x from {below} users)" if below else " (≥ 1x up to the last measured)"))
        xs = sorted(speedups)
        fig.add_scatter(
            x=xs,
            y=[speedups[b] for b in xs],
            mode="lines+markers",
            name=name,
            line=dict(color=colour),
            marker=dict(symbol=marker, size=8, color=colour),
            hovertemplate=f"{html.escape(label)}<br>%{{x}} users: %{{y:.2f}}x<extra></extra>",
        )
        if below:
            fig.add_scatter(
                x=[below],
                y=[speedups[below]],
                mode="markers",
                showlegend=False,
                marker=dict(symbol="x-thin", size=16, line=dict(width=3, color=colour)),
                hoverinfo="skip",
            )
    sizes = sorted({b for speedups, _ in curves.values() for b in speedups}) or [1, 2, 4, 8, 16, 32]
    if not curves:
        empty_note(fig, "no per-forward figures in these results (re-run the bench), or no B × k timings")
    title = f"Predicted speedup under load<br><sup>B × k timings: {html.escape(machine)}</sup>"
    return _load_layout(fig, title, "concurrent users B (sequences per forward)", "autoregressive", sizes)


def _load_layout(fig: go.Figure, title: str, x_title: str, baseline: str, sizes: list[int]) -> go.Figure:
    """Speedup against concurrency: the 1x line of the baseline, a log axis ticked at the sizes measured."""
    fig.add_hline(y=1.0, line_color="#111827", line_dash="dot", annotation_text=baseline)
    return wide_layout(
        fig,
        title,
        xaxis=dict(title=x_title, type="log", tickvals=sizes, ticktext=sizes),
        yaxis=dict(title=f"speedup over {baseline} (x)", rangemode="tozero"),
    )


def serving_curves(table, machine: str, plain_from: dict[str, int] | None = None) -> go.Figure:
    """Measured speedup over the serving engine's own autoregressive decoding against concurrent
    clients (solid), beside what our load model predicts for it (dashed), per strategy; where a
    strategy's recommendation serves plain from some load on (`plain_from`: family → B), a dotted
    line marks it."""
    fig = go.Figure()
    for strategy, b in (plain_from or {}).items():
        colour, _ = family_style(strategy)
        fig.add_vline(x=b, line=dict(color=colour, dash="dot", width=1))
        fig.add_annotation(
            x=math.log10(b), y=1.0, yref="paper", text=f"{html.escape(strategy)}: plain from {b}", showarrow=False,
            font=dict(size=10, color=colour), yanchor="bottom",
        )  # fmt: skip
    labels = [s for s in dict.fromkeys(table["strategy"]) if s != "autoregressive"][:MAX_SERIES]
    for label in labels:
        rows = table[table["strategy"] == label].sort_values("concurrency")
        colour, marker = family_style(label)
        siblings = [other for other in labels if family(other) == family(label)]
        if len(siblings) > 1:  # variants of one family: one colour, told apart by their markers
            marker = VARIANT_MARKERS[siblings.index(label) % len(VARIANT_MARKERS)]
        name = html.escape(label)
        fig.add_scatter(
            x=rows["concurrency"],
            y=rows["speedup"],
            mode="lines+markers",
            name=f"{name}: measured",
            legendgroup=name,
            line=dict(color=colour),
            marker=dict(symbol=marker, size=8, color=colour),
            hovertemplate=f"{name} measured<br>%{{x}} clients: %{{y:.2f}}x<extra></extra>",
        )
        for column, what, dash in (
            ("predicted_speedup", "predicted", "dash"),
            ("calibrated_speedup", "c from vLLM", "dot"),
        ):
            if column not in rows or rows[column].isna().all():
                continue
            if column == "calibrated_speedup" and rows[column].equals(rows.get("predicted_speedup")):
                continue  # no draft: calibrating c changes nothing
            fig.add_scatter(
                x=rows["concurrency"],
                y=rows[column],
                mode="lines",
                name=f"{name}: {what}",
                legendgroup=name,
                showlegend=False,  # one legend entry per strategy: the caption says what dashes are
                line=dict(color=colour, dash=dash),
                hovertemplate=f"{name} {what}<br>%{{x}} clients: %{{y:.2f}}x<extra></extra>",
            )
    sizes = sorted(set(table["concurrency"])) or [1]
    if table.empty:
        empty_note(fig, "no serving sweep: python -m mtp_viz bench --backend vllm measures one")
    title = f"Measured under load on a serving engine<br><sup>{html.escape(machine)}</sup>"
    return _load_layout(fig, title, "concurrent clients", "the engine's autoregressive", sizes)
