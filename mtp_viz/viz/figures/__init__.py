"""Traces, bench summaries, sweeps and profiles → plotly figures. Pure functions with one shared
style (viz/style.py), a module per subject: one run, a comparison, a bench summary, speed under
load, the theory view."""

from mtp_viz.viz.figures.bench import best_variants, category_bars, pareto, speed_quality
from mtp_viz.viz.figures.common import MAX_SERIES, family
from mtp_viz.viz.figures.compare import distribution_histogram, speedup_bars
from mtp_viz.viz.figures.load import concurrency, serving_curves
from mtp_viz.viz.figures.run import (
    accepted_length_histogram,
    position_acceptance,
    step_probabilities,
    step_timeline,
)
from mtp_viz.viz.figures.theory import exit_agreement_bars, theory_curves

__all__ = [
    "MAX_SERIES",
    "accepted_length_histogram",
    "best_variants",
    "category_bars",
    "concurrency",
    "distribution_histogram",
    "exit_agreement_bars",
    "family",
    "pareto",
    "position_acceptance",
    "serving_curves",
    "speed_quality",
    "speedup_bars",
    "step_probabilities",
    "step_timeline",
    "theory_curves",
]
