"""The result files the tabs open: what the app ships (recorded traces, bench results, serving
sweeps, profiles), each by name, and bench results folders, shipped or uploaded."""

import json
from pathlib import Path

import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.loading import model_name
from mtp_viz.machine import describe
from mtp_viz.paths import ASSETS, PROFILES
from mtp_viz.ui.trace_files import MAX_TRACE_BYTES

REQUIRED = ("category", "strategy", "tokens_per_s", "speedup", "mean_accepted_tokens", "agreement")
# what the Benchmark, Deploy? and Theory tabs open first: the embedded model as the engine runs it
# by default on a CPU (weights auto: q4 on this project's machines), with every drafter it ships
# (Spec-Bench 13 x 128 on an Intel Xeon, 2026-12-08; docs/BENCHMARKS.md)
FIRST_RESULTS = "cpu-smollm2-135m-q4-xeon"
FIRST_PROFILE = "profile-smollm2-135m-cpu-q4"


def example_traces() -> dict[str, Path]:
    """Shipped traces (recorded by scripts/make_example_traces.py), by file stem."""
    return {p.stem: p for p in sorted((ASSETS / "examples").glob("*.json"))}


def example_results() -> dict[str, Path]:
    """Shipped `python -m mtp_viz bench` results: summary.csv by folder name."""
    return {p.parent.name: p for p in sorted((ASSETS / "bench").glob("*/summary.csv"))}


def serving_sweeps() -> dict[str, Path]:
    """Shipped sweeps measured on a serving engine (`bench --backend vllm`), by folder name."""
    return {p.parent.name: p.parent for p in sorted((ASSETS / "serving").glob("*/serving.csv"))}


def shipped_profiles() -> dict[str, Path]:
    """Verify-cost curves measured with `python -m mtp_viz profile`, by file stem."""
    return {p.stem: p for p in sorted(PROFILES.glob("profile-*.json"))}


def first(found: dict[str, Path], name: str) -> dict[str, Path]:
    """`found` with `name` first where it is there (what a tab opens by default)."""
    return {name: found[name], **found} if name in found else found


def read_summary(path: str | Path) -> pd.DataFrame:
    """A bench summary.csv, checked: not too large, CSV, with the columns the views read."""
    if Path(path).stat().st_size > MAX_TRACE_BYTES:
        raise UserError("that file is too large for a bench summary")
    try:
        summary = pd.read_csv(path)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError):
        raise UserError("not a CSV file: upload the summary.csv that `python -m mtp_viz bench` writes") from None
    missing = [c for c in REQUIRED if c not in summary.columns]
    if missing:
        raise UserError(f"not a bench summary: columns {', '.join(missing)} are missing")
    return summary


def _record(path: str | Path) -> dict:
    """The summary.json beside a results folder's summary.csv ({} where there is none)."""
    try:
        record = json.loads(Path(path).with_name("summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def measured_on(path: str | Path) -> str:
    """Which machine a results folder was measured on, for the tabs' captions."""
    machine = _record(path).get("machine") or {}
    return f"Measured on {describe(machine)}." if machine else "The machine these results came from is not recorded."


def results_model(path: str | Path) -> str:
    """The model a results folder was measured on (older ones: the CPU default)."""
    return model_name(_record(path).get("model"), "cpu")
