"""Why speculation stops paying where it does: a short worked example a student can follow, in the
numbers a serving engine's profile measured (a step's fixed cost, its cost per verified token, the
speculative path's own cost, the drafter's share, the prompts' prefill) and the acceptance a sweep
measured for one strategy. Pure: a profile view and a sweep table in, Markdown out."""

import json

import pandas as pd

from mtp_viz.profile import ProfileView
from mtp_viz.schedule import Recommendation
from mtp_viz.served_costs import (
    DRAFTING,
    ServedCosts,
    at,
    drafter_per_token,
    forced_step,
    served_request,
    served_speedup,
)

PREFERRED = ("prompt_lookup", "eagle", "speculative")  # the strategy the example is told with, if measured


def seconds(t: float) -> str:
    return f"{t * 1e3:.0f} ms" if t < 1 else f"{t:.1f} s"


def clients(n: int) -> str:
    return f"{n} client{'s' * (n != 1)}"


def example_row(table: pd.DataFrame) -> pd.Series | None:
    """The row the example reads: the lowest concurrency of the preferred strategy's fixed label
    with the longest draft that measured acceptance."""
    if table.empty or not {"per_position_acceptance", "mean_accepted_tokens"} <= set(table.columns):
        return None  # a sweep that did not record acceptance
    fixed = table[~table["strategy"].str.contains(":per_batch=|:recommended", regex=True)]
    for strategy in PREFERRED:
        rows = fixed[fixed["strategy"].str.partition(":")[0] == strategy].dropna(subset=["mean_accepted_tokens"])
        depths = rows["per_position_acceptance"].map(lambda x: len(json.loads(x)) if isinstance(x, str) else 0)
        if not depths.empty and depths.max() > 0:
            return rows[depths == depths.max()].sort_values("concurrency").iloc[0]
    return None


def worked_example(view: ProfileView | None, table: pd.DataFrame, rec: Recommendation | None = None) -> str:
    """The example in Markdown ("" where the profile has no costs as served or no strategy drafted)."""
    if view is None or view.served is None or table.empty:
        return ""
    row = example_row(table)
    req = None if row is None else served_request(row)
    if req is None:  # no strategy drafted, or an older sweep without its requests' prompt lengths
        return ""
    costs: ServedCosts = view.served
    label, strategy = str(row["strategy"]), str(row["strategy"]).partition(":")[0]
    tokens, per_step, scored, prompt = req.tokens, req.per_step, req.scored, req.prompt
    positions = ", ".join(f"{p:.2f}" for p in json.loads(row["per_position_acceptance"]))
    low, high = min(costs.sizes), max(costs.sizes)
    lines = [f"**Worked example: {label}, from this profile ({view.label}) and the acceptance this sweep measured.**"]
    fit = view.step_fit or {}
    plain_low, plain_high = at(costs.plain, low, "step_s"), at(costs.plain, high, "step_s")
    if fit:
        fixed_share = fit["fixed_s"] / plain_low
        lines.append(
            f"*A step has a fixed cost.* vLLM spends about {fit['fixed_s'] * 1e3:.1f} ms on every step however "
            f"many tokens it scores, and {fit['per_token_s'] * 1e3:.2f} ms more for each token it verifies (a least "
            f"squares fit of its lockstep B × k steps): at {clients(low)} the fixed part is {fixed_share:.0%} of a "
            f"plain step ({plain_low * 1e3:.1f} ms as served)."
        )
    ratio_low = forced_step(costs, low, scored) / plain_low
    ratio_high = forced_step(costs, high, scored) / plain_high
    lines += [
        f"*What the drafts buy.* {label}'s drafts were accepted at {positions} by depth; a decode step gave "
        f"{per_step:.2f} tokens a sequence and scored {scored:.2f}.",
        f"*At {clients(low)}* a step scoring {scored:.2f} tokens costs {ratio_low:.2f}x a plain one: "
        f"{per_step:.2f} / {ratio_low:.2f} = **{per_step / ratio_low:.2f}x** (decode steps only).",
        f"*At {high} clients* the verified tokens dominate the step: a plain step costs {plain_high * 1e3:.1f} ms "
        f"and one scoring {scored:.2f} tokens a sequence {ratio_high:.2f}x that: {per_step:.2f} / {ratio_high:.2f} = "
        f"**{per_step / ratio_high:.2f}x**.",
    ]
    idle = forced_step(costs, high, 1.0) / plain_high - 1
    lines.append(
        f"*The speculative path costs even when it drafts nothing*: {idle:+.0%} a step at {high} clients "
        f"({forced_step(costs, low, 1.0) / plain_low - 1:+.0%} at {low}), which is why a 0 in vLLM's table is not "
        "plain decoding, and the recommendation serves without speculation where it stops paying."
    )
    if strategy in DRAFTING and strategy in costs.drafters:
        per_draft = [drafter_per_token(costs, strategy, c) or 0.0 for c in (low, high)]
        prefill_ratio = at(costs.drafters[strategy], high, "prefill_s") / at(costs.plain, high, "prefill_s")
        lines.append(
            f"*The drafter's share*: each drafted token adds {per_draft[0] * 1e3:.1f} ms to a step at "
            f"{clients(low)} and {per_draft[1] * 1e3:.1f} ms at {high}, and the drafter prefills every prompt too "
            f"(a round of prefills costs {prefill_ratio:.2f}x the target's alone)."
        )
    prefill_high = at(costs.plain, high, "prefill_s")
    lines.append(
        f"*Prefill is paid by both sides*: a round of {high} prompts costs {seconds(prefill_high)}, "
        f"{prefill_high / plain_high:.0f} plain decode steps, against {tokens - 1:.0f} decode steps a request: "
        "it pulls every ratio toward 1."
    )
    served = {
        c: served_speedup(costs, strategy, c, tokens, per_step, scored, prompt) for c in costs.sizes
    }  # at this acceptance, every C
    shown = ", ".join(f"{c}: {v:.2f}x" for c, v in served.items() if v is not None)
    ending = (
        f"from **{rec.plain_from}** concurrent sequences plain serving is predicted at least as fast"
        if rec is not None and rec.plain_from is not None
        else "speculation is predicted to pay up to the last concurrency measured"
    )
    lines.append(f"*So*, all of it together (clients: predicted speedup): {shown}; {ending}.")
    head, *points = lines
    return "\n".join([head, *(f"{n}. {point}" for n, point in enumerate(points, start=1))])
