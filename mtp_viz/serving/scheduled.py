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
    Recommendation,
    StepCosts,
    Table,
    deployable,
    format_table,
    measured_acceptance,
    parse_table,
)
from mtp_viz.schedule import to_vllm as table_to_vllm
from mtp_viz.served_costs import DRAFTING, ServedRequest, served_request
from mtp_viz.serving.backend import VLLMPlan
from mtp_viz.serving.methods import server_args
from mtp_viz.strategies.variants import parse_variant

AUTO = "auto"
PER_BATCH = "per_batch"  # a sweep label's suffix: "prompt_lookup:per_batch=1-2:3,3-32:0"
RECOMMENDED = "recommended"  # a sweep label's suffix: the recommended configuration at each level
LENGTH_SETTING = {"eagle": "depth"}  # the setting that sets a strategy's draft length (else num_draft_tokens)


def family(label: str) -> str:
    return str(label).partition(":")[0]


def scheduled_label(base: str, table: Table) -> str:
    return f"{base}:{PER_BATCH}={format_table(table)}"


def recommended_label(base: str) -> str:
    return f"{base}:{RECOMMENDED}"


def is_recommended(label: str) -> bool:
    return str(label).endswith(f":{RECOMMENDED}")


def length_variant(label: str, k: int) -> str:
    """A label's variant with draft length k ("prompt_lookup" → "prompt_lookup:num_draft_tokens=2")."""
    name, values = parse_variant(label)
    values = {**values, LENGTH_SETTING.get(name, "num_draft_tokens"): k}
    return name + "".join(f":{key}={value}" for key, value in values.items())


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


def step_costs(view: ProfileView, strategy: str, request: tuple[float, float] | None = None) -> StepCosts:
    """A profile's step costs as the schedule reads them, with the strategy's drafter cost (and its
    costs as served, for requests of (output tokens, prompt tokens), where measured)."""
    if not view.batch_cost:
        raise UserError("this profile has no B × k timings: `python -m mtp_viz profile --backend vllm` measures them")
    draft = view.draft_cost.get(strategy) if view.draft_cost else view.c
    served = view.served if view.served is not None and request is not None else None
    return StepCosts(view.batch_cost, view.one_token_s, draft, served, strategy, request or StepCosts.request)


def row_acceptance(table: pd.DataFrame, label: str, k: int, request: ServedRequest | None = None) -> Acceptance | None:
    """The acceptance a sweep measured for a fixed-length label (its lowest concurrency's row): per
    forward, or per decode step where `request` (that row's, served_request) is given, as the
    served costs price a decode step (a forward's figures count the prefill's among them)."""
    rows = table[table["strategy"] == label].sort_values("concurrency")
    if rows.empty or k < 1 or pd.isna(rows["mean_accepted_tokens"].iloc[0]):
        return None
    row = rows.iloc[0]
    positions = [float(x) for x in json.loads(row["per_position_acceptance"] or "[]")]
    accepted, scored = float(row["mean_accepted_tokens"]), float(row["scored_per_forward"])
    if request is not None:
        accepted, scored = request.per_step, request.scored
    if math.isnan(scored) or not positions:
        return None
    return measured_acceptance(accepted, scored, positions, k, family(label) in DRAFTING)


def longest_fixed(table: pd.DataFrame, strategy: str) -> tuple[str, int] | None:
    """The fixed-length label of a strategy with the longest draft in a sweep, and that length."""
    best = None
    for label in dict.fromkeys(table["strategy"]):
        base, schedule = split_label(label)
        if schedule is not None or is_recommended(base) or family(base) != strategy:
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


def auto_schedule(table: pd.DataFrame, view: ProfileView, label: str, k: int, max_batch: int) -> Recommendation:
    """The configuration our load model recommends for a fixed label's strategy from its measured
    acceptance, with drafts up to the length that label ran with (and the profile timed)."""
    rows = table[table["strategy"] == label].sort_values("concurrency")
    # what a request of this sweep decodes and prefills (served costs); a sweep without it: lockstep
    served = served_request(rows.iloc[0]) if view.served is not None and not rows.empty else None
    acceptance = row_acceptance(table, label, k, served)
    if acceptance is None:
        raise UserError(f"{label} measured no acceptance to schedule from")
    costs = step_costs(view, family(label), None if served is None else (served.tokens, served.prompt))
    if costs.served is not None:
        timed = max(costs.served.forced) - 1
        max_batch = min(max_batch, max(costs.served.sizes))  # no prediction past the loads it measured
    else:
        timed = max(max(row) for row in view.batch_cost.values()) - 1  # drafts the profile timed
    # no longer than the fixed length measured: its acceptance is known only that far
    return deployable(costs, acceptance, max_batch, min(MAX_DRAFT, timed, k))
