"""Trace → plotly figures. Pure functions; one shared style (viz/style.py)."""

import html
import re

import plotly.graph_objects as go

from mtp_viz.labels import is_peer
from mtp_viz.trace import Trace, engine_label, timed
from mtp_viz.viz.style import (
    DRAFT_TIME_COLOUR,
    FAMILY_COLOURS,
    FAMILY_MARKERS,
    OTHER_TIME_COLOUR,
    P_COLOUR,
    PEER_COLOUR,
    PEER_MARKER,
    Q_COLOUR,
    VERDICT_COLOURS,
    VERIFY_TIME_COLOUR,
)

LAYOUT = dict(
    template="plotly_white", margin=dict(l=50, r=20, t=40, b=40), height=320, legend=dict(orientation="h", y=1.12, x=0)
)


def _empty_note(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(
        text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font=dict(size=14, color="#6b7280")
    )
    return fig


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
        _empty_note(fig, f"Per-step timings: {not_reported(trace)} (only the whole request's)")
    for name, values, colour in bars:
        fig.add_bar(
            x=x,
            y=values,
            name=name,
            marker_color=colour,
            customdata=texts,
            hovertemplate="step %{x}: %{y:.1f} ms<br>tokens: %{customdata}<extra>" + name + "</extra>",
        )
    fig.add_scatter(
        x=x,
        y=[len(s.drafted) for s in steps],
        name="tokens drafted",
        yaxis="y2",
        mode="lines+markers",
        line=dict(color="#6b7280", dash="dot"),
    )
    fig.add_scatter(
        x=x,
        y=[len(s.emitted) for s in steps],
        name="tokens emitted",
        yaxis="y2",
        mode="lines+markers",
        line=dict(color="#16a34a"),
    )
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
        return _empty_note(fig, f"Draft and target probabilities: {not_reported(trace)}")
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
    from collections import Counter

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


def theory_curves(
    alpha: float, c: float, verify_costs: list[tuple[str, dict[int, float]]], points: list[dict], max_gamma: int = 16
) -> go.Figure:
    """Predicted speedup against draft length γ: textbook (verifying costs one forward) and with each
    measured verify-cost curve (labelled with its machine); runs' measured speedups as points."""
    from mtp_viz.theory import optimal_gamma, speedup

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


MAX_SERIES = 8  # no figure draws more series than this: a projector can't show more
VARIANT_MARKERS = ("circle", "square", "diamond", "triangle-up", "cross")


def family(label: str) -> str:
    """ "mtp_heads:tree=chain" → "mtp_heads": the strategy a bench label is a variant of."""
    return str(label).split(":")[0]


def family_style(label: str) -> tuple[str, str]:
    """(colour, marker) of a bench label: its family's, or the peers' grey cross."""
    if is_peer(label):
        return PEER_COLOUR, PEER_MARKER
    f = family(label)
    return FAMILY_COLOURS.get(f, "#374151"), FAMILY_MARKERS.get(f, "circle")


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


def _bench_layout(fig: go.Figure, title: str, **extra) -> go.Figure:
    """The bench figures' layout: legend below the plot (never over the bars), room for it."""
    layout = {**LAYOUT, "legend": dict(orientation="h", x=0, y=-0.18, yanchor="top"), "height": 420}
    layout["margin"] = dict(l=50, r=20, t=40, b=110)
    fig.update_layout(**layout, title=title, **extra)
    return fig


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
        _empty_note(fig, "choose strategies to compare")
    return _bench_layout(fig, title, barmode="group")


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
    return _bench_layout(fig, f"Speed against quality ({quality})", xaxis_title="speedup (x)", yaxis_title=quality)


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
        _empty_note(fig, "no per-forward figures in these results (re-run the bench), or no B × k timings")
    title = f"Predicted speedup under load<br><sup>B × k timings: {html.escape(machine)}</sup>"
    return _load_layout(fig, title, "concurrent users B (sequences per forward)", "autoregressive", sizes)


def _load_layout(fig: go.Figure, title: str, x_title: str, baseline: str, sizes: list[int]) -> go.Figure:
    """Speedup against concurrency: the 1x line of the baseline, a log axis ticked at the sizes measured."""
    fig.add_hline(y=1.0, line_color="#111827", line_dash="dot", annotation_text=baseline)
    return _bench_layout(
        fig,
        title,
        xaxis=dict(title=x_title, type="log", tickvals=sizes, ticktext=sizes),
        yaxis=dict(title=f"speedup over {baseline} (x)", rangemode="tozero"),
    )


def serving_curves(table, machine: str) -> go.Figure:
    """Measured speedup over the serving engine's own autoregressive decoding against concurrent
    clients (solid), beside what our load model predicts for it (dashed), per strategy."""
    fig = go.Figure()
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
                line=dict(color=colour, dash=dash),
                hovertemplate=f"{name} {what}<br>%{{x}} clients: %{{y:.2f}}x<extra></extra>",
            )
    sizes = sorted(set(table["concurrency"])) or [1]
    if table.empty:
        _empty_note(fig, "no serving sweep: python -m mtp_viz bench --backend vllm measures one")
    title = f"Measured under load on a serving engine<br><sup>{html.escape(machine)}</sup>"
    return _load_layout(fig, title, "concurrent clients", "the engine's autoregressive", sizes)


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
    return _bench_layout(
        fig,
        f"The lossy trade-off ({quality})",
        xaxis_title="speedup over autoregressive (x)",
        yaxis=dict(title=f"{quality} (paper: 1 − accuracy loss)", range=[0, 1.05]),
    )


def exit_agreement_bars(agreement: dict[int, float] | None) -> go.Figure:
    """Profile → per layer L, how often an early exit after L layers picks the model's own next token."""
    fig = go.Figure()
    if not agreement:
        return _empty_note(fig, "this profile has no early-exit agreement (python -m mtp_viz profile measures it)")
    layers = sorted(agreement)
    fig.add_bar(x=layers, y=[agreement[k] for k in layers], marker_color=Q_COLOUR, name="agreement")
    fig.update_layout(
        **LAYOUT,
        title="Early exit after layer L: top-1 agrees with the full model",
        xaxis_title="exit layer L (self_speculative's exit_layer)",
        yaxis=dict(title="share of answer tokens", range=[0, 1.05]),
    )
    return fig
