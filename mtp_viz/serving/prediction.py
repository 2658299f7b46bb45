"""Our load model beside a measured sweep: the speedup it predicts for each row from a profile of
this device (with a serving engine's costs as served, mtp_viz.served_costs; else its lockstep
step grid through mtp_viz.theory), the same with the draft's cost as the serving engine pays it
at one client, and how far off each is."""

import math

import pandas as pd

from mtp_viz.profile import DraftCost, Prefill
from mtp_viz.served_costs import DRAFTING, ServedCosts, served_request, served_speedup
from mtp_viz.theory import concurrency_speedup, interpolated


def predicted(
    row: pd.Series, batch_cost: dict[int, dict[int, float]], c: DraftCost, prefill: Prefill | None = None
) -> float:
    """Our load model's speedup for this row's strategy at its concurrency (mtp_viz.theory), from
    the tokens per forward vLLM measured, as the Deploy? view predicts it. With a serving engine's
    own profile, batch_cost is the engine's step curve, c its drafter's cost per strategy and B,
    and `prefill` what the row's prompts add to the work of both sides (with_prefill)."""
    decode = _decode_speedup(row, batch_cost, c)
    return with_prefill(decode, row, prefill) if prefill is not None else decode


def with_prefill(decode: float, row: pd.Series, prefill: Prefill) -> float:
    """A decode-only speedup with the prompts' prefill added to both sides: B requests of P prompt
    tokens add B·P·t (t: the engine's cost of a token in a step) to the N decode steps of a
    one-token step T(B, 1) each, so speedup = (N + π) / (N / decode + π), π = B·P·t / T(B, 1)."""
    per_token_s, one_token_s = prefill
    b = int(row["concurrency"])
    prompt = row.get("prompt_tokens", math.nan)
    if math.isnan(decode) or pd.isna(prompt) or b not in one_token_s or not row.get("requests"):
        return decode
    n = float(row["new_tokens"]) / float(row["requests"])
    share = b * float(prompt) * per_token_s / one_token_s[b]
    return (n + share) / (n / decode + share)


def _decode_speedup(row: pd.Series, batch_cost: dict[int, dict[int, float]], c: DraftCost) -> float:
    b = int(row["concurrency"])
    if b not in batch_cost or pd.isna(row["mean_accepted_tokens"]):
        return math.nan
    drafting = uses_draft(row["strategy"])  # a draft forward per drafted token
    cost = draft_cost_at(c, row["strategy"], b) if drafting else 0.0
    if cost is None:
        return math.nan
    drafts = float(row["scored_per_forward"]) - 1.0 if drafting else 0.0
    tokens, scored = float(row["mean_accepted_tokens"]), float(row["scored_per_forward"])
    return concurrency_speedup(tokens, scored, drafts, cost, {b: batch_cost[b]})[b]


def draft_cost_at(c: DraftCost, label: str, b: int) -> float | None:
    """A drafted token's cost for a label's strategy at B: the engine's where it measured it
    (strategy → B → cost), else the profile's one c; None where unknown."""
    if isinstance(c, dict):
        per_batch = c.get(str(label).partition(":")[0])
        return None if per_batch is None or b not in per_batch else per_batch[b]
    return c


def uses_draft(label: str) -> bool:
    return str(label).partition(":")[0] in DRAFTING  # a label is "strategy[:name=value...]"


def engine_draft_cost(table: pd.DataFrame, batch_cost: dict[int, dict[int, float]]) -> dict[str, float]:
    """c as the serving engine pays it, per draft-model label, from its single-client row: a step
    costs (tokens per forward / speedup) autoregressive steps; less the verify cost our profile
    gives for the tokens it scored, per draft forward. Our engine's c (the profile's) leaves out
    what the serving engine spends on each draft step besides the draft's layers."""
    costs = {}
    for _, row in table[(table["concurrency"] == 1) & table["strategy"].map(uses_draft)].iterrows():
        drafts = float(row["scored_per_forward"]) - 1.0
        if 1 not in batch_cost or drafts <= 0 or pd.isna(row["speedup"]):
            continue
        step = float(row["mean_accepted_tokens"]) / float(row["speedup"])
        costs[row["strategy"]] = max(
            0.0, (step - interpolated(batch_cost[1], float(row["scored_per_forward"]))) / drafts
        )
    return costs


def served_prediction(row: pd.Series, costs: ServedCosts) -> float:
    """A row's speedup from a serving engine's costs as served: its requests' tokens, the tokens a
    decode step gave and scored (the sweep's measurement), at its concurrency."""
    strategy = str(row["strategy"]).partition(":")[0]
    if strategy == "autoregressive":
        return 1.0
    req = served_request(row)
    if req is None:
        return math.nan
    value = served_speedup(costs, strategy, int(row["concurrency"]), req.tokens, req.per_step, req.scored, req.prompt)
    return math.nan if value is None else value


def with_prediction(
    table: pd.DataFrame,
    batch_cost: dict[int, dict[int, float]] | None,
    c: DraftCost,
    prefill: Prefill | None = None,
    served: ServedCosts | None = None,
) -> pd.DataFrame:
    """The sweep's rows with our load model's prediction from a profile (`predicted_speedup`: from
    the engine's costs as served where the profile has them), the same with the draft's cost
    measured on the serving engine at one client (`calibrated_speedup`; `engine_c`; the same as
    predicted where the costs were served), and how far off each is ((predicted − measured) /
    measured); NaN where the profile has no timings for that concurrency."""
    table = table.copy()
    batch_cost = batch_cost or {}
    engine_c = {} if isinstance(c, dict) or served else engine_draft_cost(table, batch_cost)
    table["engine_c"] = table["strategy"].map(engine_c)
    source = table["served_as"] if "served_as" in table else pd.Series(math.nan, index=table.index)
    as_served = table.assign(strategy=source.where(source.notna(), table["strategy"]))  # what each row measured
    if served is not None:
        table["predicted_speedup"] = [served_prediction(row, served) for _, row in as_served.iterrows()]
        table["calibrated_speedup"] = table["predicted_speedup"]
    else:
        table["predicted_speedup"] = [predicted(row, batch_cost, c, prefill) for _, row in as_served.iterrows()]
        table["calibrated_speedup"] = [
            predicted(row, batch_cost, engine_c.get(row["strategy"], c), prefill) for _, row in as_served.iterrows()
        ]
    for column, error in (("predicted_speedup", "prediction_error"), ("calibrated_speedup", "calibrated_error")):
        table[error] = (table[column] - table["speedup"]) / table["speedup"]
    return table
