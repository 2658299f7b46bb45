"""The Theory view's figures: predicted speedup against draft length (textbook and with measured
verify costs, runs' measured points), and a profile's early-exit agreement by layer."""

import html

import plotly.graph_objects as go

from mtp_viz.theory import optimal_gamma, speedup
from mtp_viz.viz.figures.common import LAYOUT, empty_note
from mtp_viz.viz.style import Q_COLOUR


def theory_curves(
    alpha: float, c: float, verify_costs: list[tuple[str, dict[int, float]]], points: list[dict], max_gamma: int = 16
) -> go.Figure:
    """Predicted speedup against draft length γ: textbook (verifying costs one forward) and with each
    measured verify-cost curve (labelled with its machine); runs' measured speedups as points."""
    gammas = list(range(0, max_gamma + 1))
    fig = go.Figure()
    fig.add_scatter(x=gammas, y=[speedup(alpha, g, c) for g in gammas], name="textbook (Leviathan et al.)")
    best = optimal_gamma(alpha, c, max_gamma)
    fig.add_vline(x=best, line_dash="dot", line_color="#2563eb", annotation_text=f"best γ = {best}")
    for label, verify_cost in verify_costs:
        usable = [g for g in gammas if g + 1 in verify_cost]
        fig.add_scatter(
            x=usable,
            y=[speedup(alpha, g, c, verify_cost) for g in usable],
            name=f"measured verify cost: {html.escape(label)}",
            line=dict(dash="dash"),
        )
    for p in points:
        fig.add_scatter(
            x=[p["gamma"]],
            y=[p["speedup"]],
            mode="markers",
            marker=dict(size=11, symbol="diamond"),
            name=html.escape(p["label"]),
            hovertemplate=(
                f"measured: α = {p['alpha']:.2f}, γ = {p['gamma']:.1f}, c = {p['c']:.2f}<br>"
                "speedup %{y:.2f}x<extra></extra>"
            ),
        )
    fig.add_hline(y=1.0, line_color="#9ca3af")
    fig.update_layout(
        **LAYOUT,
        title=f"Predicted speedup, α = {alpha:.2f}, c = {c:.2f}",
        xaxis_title="γ (draft length)",
        yaxis_title="x",
    )
    return fig


def exit_agreement_bars(agreement: dict[int, float] | None) -> go.Figure:
    """Profile → per layer L, how often an early exit after L layers picks the model's own next token."""
    fig = go.Figure()
    if not agreement:
        return empty_note(fig, "this profile has no early-exit agreement (python -m mtp_viz profile measures it)")
    layers = sorted(agreement)
    fig.add_bar(x=layers, y=[agreement[k] for k in layers], marker_color=Q_COLOUR, name="agreement")
    fig.update_layout(
        **LAYOUT,
        title="Early exit after layer L: top-1 agrees with the full model",
        xaxis_title="exit layer L (self_speculative's exit_layer)",
        yaxis=dict(title="share of answer tokens", range=[0, 1.05]),
    )
    return fig
