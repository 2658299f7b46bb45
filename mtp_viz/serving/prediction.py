"""Our load model (mtp_viz.theory) beside a measured sweep: the speedup it predicts for each row
from a profile of this device, the same with the draft's cost as the serving engine pays it, and
how far off each is."""

import math

import pandas as pd

from mtp_viz.profile import DraftCost, Prefill
from mtp_viz.theory import concurrency_speedup, interpolated

DRAFTING = ("speculative", "eagle")  # a drafter forward per drafted token: its cost ratio c counts


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


def with_prediction(
    table: pd.DataFrame, batch_cost: dict[int, dict[int, float]] | None, c: DraftCost, prefill: Prefill | None = None
) -> pd.DataFrame:
    """The sweep's rows with our load model's prediction from a profile (`predicted_speedup`), the
    same with the draft's cost measured on the serving engine at one client (`calibrated_speedup`;
    `engine_c`), and how far off each is ((predicted − measured) / measured); NaN where the
    profile has no timings for that concurrency."""
    table = table.copy()
    batch_cost = batch_cost or {}
    engine_c = {} if isinstance(c, dict) else engine_draft_cost(table, batch_cost)  # the engine's own: no need
    table["engine_c"] = table["strategy"].map(engine_c)
    table["predicted_speedup"] = [predicted(row, batch_cost, c, prefill) for _, row in table.iterrows()]
    table["calibrated_speedup"] = [
        predicted(row, batch_cost, engine_c.get(row["strategy"], c), prefill) for _, row in table.iterrows()
    ]
    for column, error in (("predicted_speedup", "prediction_error"), ("calibrated_speedup", "calibrated_error")):
        table[error] = (table[column] - table["speedup"]) / table["speedup"]
    return table
