"""A speculation schedule served on vLLM: its label in a sweep, its server (the strategy's
speculative_config with `num_speculative_tokens_per_batch_size`), and `auto`: the schedule our
load model recommends from a profile and the acceptance the sweep measured for a fixed length."""

import json
import math
from dataclasses import replace

import pandas as pd

from mtp_viz.errors import UserError
from mtp_viz.profile import ProfileView
from mtp_viz.schedule import (
    MAX_DRAFT,
    Acceptance,
    StepCosts,
    Table,
    format_table,
    measured_acceptance,
    parse_table,
    recommend,
)
from mtp_viz.schedule import to_vllm as table_to_vllm
from mtp_viz.serving.backend import VLLMPlan
from mtp_viz.serving.methods import server_args

AUTO = "auto"
PER_BATCH = "per_batch"  # a sweep label's suffix: "prompt_lookup:per_batch=1-2:3,3-32:0"
DRAFTING = ("speculative", "eagle")  # each drafted token costs a drafter forward


def family(label: str) -> str:
    return str(label).partition(":")[0]


def scheduled_label(base: str, table: Table) -> str:
    return f"{base}:{PER_BATCH}={format_table(table)}"


def split_label(label: str) -> tuple[str, Table | None]:
    """(the fixed variant a label is based on, its schedule or None)."""
    base, sep, table = str(label).partition(f":{PER_BATCH}=")
    return (base, parse_table(table)) if sep else (base, None)


def draft_length(p: VLLMPlan) -> int:
    return int((p.speculative_config or {}).get("num_speculative_tokens", 0))


def scheduled_plan(p: VLLMPlan, table: Table) -> VLLMPlan | None:
    """The fixed variant's server with the schedule (num_speculative_tokens: its longest draft,
    which vLLM caps every range at); None where it never drafts (plain decoding serves it)."""
    longest = max(k for _, _, k in table)
    if p.speculative_config is None or longest == 0:
        return None
    spec = {
        **p.speculative_config,
        "num_speculative_tokens": longest,
        "num_speculative_tokens_per_batch_size": table_to_vllm(table),
    }
    return replace(p, speculative_config=spec, server=replace(p.server, extra_args=tuple(server_args(spec))))


def step_costs(view: ProfileView, strategy: str) -> StepCosts:
    """A profile's step costs as the schedule reads them, with the strategy's drafter cost."""
    if not view.batch_cost:
        raise UserError("this profile has no B × k timings: `python -m mtp_viz profile --backend vllm` measures them")
    draft = view.draft_cost.get(strategy) if view.draft_cost else view.c
    return StepCosts(view.batch_cost, view.one_token_s, draft)


def row_acceptance(table: pd.DataFrame, label: str, k: int) -> Acceptance | None:
    """The acceptance a sweep measured for a fixed-length label (its lowest concurrency's row)."""
    rows = table[table["strategy"] == label].sort_values("concurrency")
    if rows.empty or k < 1 or pd.isna(rows["mean_accepted_tokens"].iloc[0]):
        return None
    row = rows.iloc[0]
    positions = [float(x) for x in json.loads(row["per_position_acceptance"] or "[]")]
    scored = float(row["scored_per_forward"])
    if math.isnan(scored) or not positions:
        return None
    return measured_acceptance(float(row["mean_accepted_tokens"]), scored, positions, k, family(label) in DRAFTING)


def longest_fixed(table: pd.DataFrame, strategy: str) -> tuple[str, int] | None:
    """The fixed-length label of a strategy with the longest draft in a sweep, and that length."""
    best = None
    for label in dict.fromkeys(table["strategy"]):
        base, schedule = split_label(label)
        if schedule is not None or family(base) != strategy:
            continue
        rows = table[table["strategy"] == label]
        k = _length_of(rows)
        if k and (best is None or k > best[1]):
            best = (label, k)
    return best


def _length_of(rows: pd.DataFrame) -> int:
    """The draft length a fixed label ran with: vLLM drafts at most that many per step."""
    if "per_position_acceptance" not in rows or pd.isna(rows["per_position_acceptance"].iloc[0]):
        return 0  # a sweep that did not record it
    return len(json.loads(rows["per_position_acceptance"].iloc[0] or "[]"))


def auto_schedule(table: pd.DataFrame, view: ProfileView, label: str, k: int, max_batch: int) -> Table:
    """The schedule our load model recommends for a fixed label's strategy from its measured
    acceptance, with drafts up to the length that label ran with."""
    acceptance = row_acceptance(table, label, k)
    if acceptance is None:
        raise UserError(f"{label} measured no acceptance to schedule from")
    timed = max(max(row) for row in view.batch_cost.values()) - 1  # drafts the profile timed
    # no longer than the fixed length measured: its acceptance is known only that far
    return recommend(step_costs(view, family(label)), acceptance, max_batch, min(MAX_DRAFT, timed, k))
