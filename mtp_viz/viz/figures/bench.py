"""A bench summary → figures: a value per category, speed against quality, and the lossy
strategies' trade-off beside the paper's points; at most MAX_SERIES series each."""

import html
import re

import plotly.graph_objects as go

from mtp_viz.labels import is_peer
from mtp_viz.viz.figures.common import MAX_SERIES, empty_note, family, family_style, wide_layout


def best_variants(summary, limit: int = MAX_SERIES) -> list[str]:
    """The variant of each strategy family with the best overall speedup, best first, then the
    fastest transformers peer, at most `limit`; autoregressive (the 1.0 line) left out."""
    overall = summary[summary["category"] == "overall"].sort_values("speedup", ascending=False)
    chosen, families, peer = [], set(), None
    for label in overall["strategy"]:
        if is_peer(label):
            peer = peer or label
        elif label != "autoregressive" and family(label) not in families:
            families.add(family(label))
            chosen.append(label)
    return (chosen + ([peer] if peer else []))[:limit]


def category_bars(summary, value: str, title: str, strategies: list[str] | None = None) -> go.Figure:
    """A bench summary table → bars of `value` per category for at most MAX_SERIES strategies
    (default: the best variant of each family), coloured by family; speedup 1.0 drawn as a line."""
    strategies = list(strategies if strategies is not None else best_variants(summary))[:MAX_SERIES]
    fig = go.Figure()
    categories = list(dict.fromkeys(summary["category"]))
    seen: dict[str, int] = {}  # family → variants drawn so far: later ones are hatched
    for label in strategies:
        rows = summary[summary["strategy"] == label].set_index("category")
        colour, _ = family_style(label)
        n = seen[family(label)] = seen.get(family(label), -1) + 1
        fig.add_bar(
            x=[html.escape(str(c)) for c in categories],
            y=[rows[value].get(c) for c in categories],
            name=html.escape(str(label)),
            marker_color=colour,
            marker_pattern_shape=("", "/", "x", ".", "-")[n % 5],
        )
    if value == "speedup":
        fig.add_hline(y=1.0, line_color="#111827", line_dash="dot", annotation_text="autoregressive")
    if not strategies:
        empty_note(fig, "choose strategies to compare")
    return wide_layout(fig, title, barmode="group")


def speed_quality(summary, quality: str = "agreement", strategies: list[str] | None = None) -> go.Figure:
    """Overall speedup against quality (agreement with autoregressive) per strategy: the Pareto view
    of lossy strategies (lossless ones sit at agreement 1). One marker per strategy, its family's
    colour and shape; names in the legend and on hover, never as overlapping text."""
    strategies = list(strategies if strategies is not None else best_variants(summary))[:MAX_SERIES]
    overall = summary[summary["category"] == "overall"].set_index("strategy").reindex(strategies).reset_index()
    fig = go.Figure()
    for _, row in overall.iterrows():
        colour, marker = family_style(row["strategy"])
        name = html.escape(str(row["strategy"]))
        fig.add_scatter(
            x=[row["speedup"]],
            y=[row[quality]],
            mode="markers",
            name=name,
            marker=dict(size=13, color=colour, symbol=marker, line=dict(width=1, color="#111827")),
            hovertemplate=f"{name}<br>speedup %{{x:.2f}}x<br>{quality} %{{y:.3f}}<extra></extra>",
        )
    fig.add_vline(x=1.0, line_color="#9ca3af", line_dash="dot")
    return wide_layout(fig, f"Speed against quality ({quality})", xaxis_title="speedup (x)", yaxis_title=quality)


# The paper's published points (Kirchenbauer et al., arXiv 2602.06019, ConfAdapt at τ = 0.9):
# (label, speedup, 1 − GSM8K accuracy loss). Other models and hardware: reference marks only.
PAPER_POINTS = (
    ("paper: Llama-3.1-8B-Magpie, τ=0.9 (>3x, <3% loss)", 3.0, 0.97),
    ("paper: Qwen3-4B (3x, 7% loss)", 3.0, 0.93),
)


def pareto(summary, quality: str = "math_answer_match") -> go.Figure:
    """The lossy strategies' speed/quality trade-off: every ConfAdapt and mask-token variant of a
    bench (τ sweep, fixed k), a line per family through its variants by speed, autoregressive and
    the lossless strategies at quality 1, and the paper's published points as reference marks.
    quality: a summary column in [0, 1] (default: math final answers the same as autoregressive's;
    agreement where a summary has no math prompts)."""
    overall = summary[summary["category"] == "overall"]
    if quality not in overall or overall[quality].isna().all():
        quality = "agreement"
    fig = go.Figure()
    lossy = overall[overall["strategy"].map(family).isin(("conf_adapt",))]
    predictor = lossy["strategy"].map(lambda s: re.search(r"predictor=(\w+)", str(s)))
    predictor = predictor.map(lambda m: f", {m.group(1).replace('_', ' ')}" if m else "")
    for (fam, pred), rows in lossy.groupby([lossy["strategy"].map(family), predictor]):
        rows = rows.sort_values("speedup")
        colour, marker = family_style(fam)
        colour = "#f9a8d4" if pred == ", heads" else colour
        fig.add_scatter(
            x=rows["speedup"],
            y=rows[quality],
            mode="lines+markers",
            name=html.escape(f"{fam}{pred} (each variant)"),
            line=dict(color=colour),
            marker=dict(symbol=marker, size=10, color=colour),
            text=[html.escape(str(s)) for s in rows["strategy"]],
            hovertemplate="%{text}<br>speedup %{x:.2f}x<br>" + quality + " %{y:.3f}<extra></extra>",
        )
    lossless = overall[~overall["strategy"].map(family).isin(("conf_adapt",))]
    lossless = lossless[~lossless["strategy"].map(is_peer)]
    fig.add_scatter(
        x=lossless["speedup"],
        y=[1.0] * len(lossless),
        mode="markers",
        name="lossless strategies",
        marker=dict(symbol="circle-open", size=10, color="#111827"),
        text=[html.escape(str(s)) for s in lossless["strategy"]],
        hovertemplate="%{text}<br>speedup %{x:.2f}x (lossless)<extra></extra>",
    )
    for label, x, y in PAPER_POINTS:
        fig.add_scatter(
            x=[x],
            y=[y],
            mode="markers",
            name=html.escape(label),
            marker=dict(symbol="star-diamond-open", size=14, color="#6b7280", line=dict(width=2)),
            hovertemplate=html.escape(label) + "<extra>published, other model and hardware</extra>",
        )
    fig.add_vline(x=1.0, line_color="#9ca3af", line_dash="dot")
    return wide_layout(
        fig,
        f"The lossy trade-off ({quality})",
        xaxis_title="speedup over autoregressive (x)",
        yaxis=dict(title=f"{quality} (paper: 1 − accuracy loss)", range=[0, 1.05]),
    )
