"""The serving engine's costs as served (mtp_viz.served_costs): the request-cost model checked by hand,
a sweep row's prediction from it, the deployable recommendation it gives, a profile's round trip, and
the served timings' arithmetic (mtp_viz.serving.served_levels) on scripted rounds."""

import json
import math

import pandas as pd
import pytest

from mtp_viz.profile import Profile, read_profile
from mtp_viz.schedule import Acceptance, StepCosts, deployable, predicted_speedup
from mtp_viz.served_costs import Level, ServedCosts, served_request, served_speedup, step
from mtp_viz.serving import served_levels
from mtp_viz.serving.client import Completion
from mtp_viz.serving.in_vllm.forced_drafts import CODE_BASE
from mtp_viz.serving.prediction import with_prediction


def level(step_ms: float, prefill_ms: float = 100.0, prompt: float = 200.0) -> Level:
    return Level(step_ms / 1e3, prefill_ms / 1e3, prompt, 48.0)


# C = 1: a plain step 20 ms; the speculative path 22 ms drafting nothing (10% of its own), 24 ms
# scoring 4 tokens; C = 8: plain 40 ms, the path 44 ms, 160 ms for 4 tokens. EAGLE-3 at 3 drafts:
# 30 ms at C = 1 (2 ms a drafted token beyond the forced step), 98 ms at C = 8 (6 ms), and its
# prefill round twice the target's (the drafter prefills every prompt too).
COSTS = ServedCosts(
    plain={1: level(20), 8: level(40, 400)},
    forced={1: {1: level(22), 8: level(44, 400)}, 4: {1: level(24), 8: level(160, 400)}},
    drafters={"eagle": {1: level(30, 200), 8: level(98, 800)}},
    lengths={"eagle": 3},
    new_tokens=49,
)


def test_a_request_costs_its_decode_steps_and_its_round_of_prefills_on_each_side():
    # 49 tokens: 48 decode steps plain (48 × 20 + 100 = 1060 ms); 2 tokens a step scoring 4: 24 steps of 24 ms
    assert served_speedup(COSTS, "prompt_lookup", 1, 49, 2.0, 4.0, 200) == pytest.approx(1060 / (24 * 24 + 100))
    # drafting nothing still pays the speculative path: 48 × 22 + 100
    assert served_speedup(COSTS, "prompt_lookup", 1, 49, 1.0, 1.0, 200) == pytest.approx(1060 / 1156)
    # a prompt twice as long doubles both rounds of prefill
    assert served_speedup(COSTS, "prompt_lookup", 1, 49, 2.0, 4.0, 400) == pytest.approx(1160 / (24 * 24 + 200))
    # EAGLE-3 with one draft: the forced step scoring 2 (22 + 2/3 ms) plus 2 ms, and its own prefill round
    assert step(COSTS, "eagle", 1, 2.0) == pytest.approx((22 + 2 / 3 + 2) / 1e3)
    assert served_speedup(COSTS, "eagle", 1, 49, 1.5, 2.0, 200) == pytest.approx(1060 / (32 * (24 + 2 / 3) + 200))
    # between measured concurrencies, linear in C: at 4, plain 20 + 3/7 of 20 ms
    plain_at_4 = 48 * (20 + 20 * 3 / 7) + 100 + 300 * 3 / 7
    forced_at_4 = 48 * (22 + 22 * 3 / 7) + 100 + 300 * 3 / 7
    assert served_speedup(COSTS, "prompt_lookup", 4, 49, 1.0, 1.0, 200) == pytest.approx(plain_at_4 / forced_at_4)
    assert served_speedup(COSTS, "speculative", 1, 49, 2.0, 4.0, 200) is None  # its drafter was not measured


def test_a_sweep_row_is_predicted_from_its_own_tokens_per_step_and_a_recommended_row_as_what_it_served():
    rows = [
        # 4 requests of 49 tokens in 100 forwards (25 each: the prefill and 24 decode steps of 2 tokens),
        # 3 drafts a decode step (scored per forward counts the prefill's single token too)
        {"strategy": "prompt_lookup", "concurrency": 1, "new_tokens": 196, "requests": 4, "prompt_tokens": 200.0,
         "mean_accepted_tokens": 196 / 100, "scored_per_forward": (100 + 24 * 3 * 4) / 100, "speedup": 1.5},
        {"strategy": "autoregressive", "concurrency": 1, "new_tokens": 196, "requests": 4, "prompt_tokens": 200.0,
         "mean_accepted_tokens": 1.0, "scored_per_forward": 1.0, "speedup": 1.0},
        {"strategy": "prompt_lookup:recommended", "concurrency": 8, "new_tokens": 196, "requests": 4,
         "prompt_tokens": 200.0, "mean_accepted_tokens": 1.0, "scored_per_forward": 1.0, "speedup": 1.0,
         "served_as": "autoregressive"},
    ]  # fmt: skip
    table = with_prediction(pd.DataFrame(rows), None, None, None, COSTS)
    assert table["predicted_speedup"].tolist() == pytest.approx([1060 / (24 * 24 + 100), 1.0, 1.0])
    assert table["prediction_error"].iloc[0] == pytest.approx((1060 / 676 - 1.5) / 1.5)
    between = with_prediction(pd.DataFrame([{**rows[0], "concurrency": 4}]), None, None, None, COSTS)
    at_8 = with_prediction(pd.DataFrame([{**rows[0], "concurrency": 8}]), None, None, None, COSTS)
    assert at_8["predicted_speedup"].iloc[0] < between["predicted_speedup"].iloc[0] < 1060 / 676  # linear in C
    older = pd.DataFrame([{k: v for k, v in rows[0].items() if k != "prompt_tokens"}])  # a sweep without it
    assert math.isnan(with_prediction(older, None, None, None, COSTS)["predicted_speedup"].iloc[0])


def test_the_recommendation_serves_plain_from_the_load_where_no_length_pays_by_the_margin():
    lookup = Acceptance((0.9, 0.8, 0.7), 1.0, 1.0, draft_forwards=False)
    served = StepCosts({1: {1: 1.0}, 8: {1: 1.0}}, served=COSTS, strategy="prompt_lookup", request=(49.0, 200.0))
    assert predicted_speedup(served, lookup, 8, 0) < 1.0  # a 0 in the table still costs the path
    rec = deployable(served, lookup, 8, max_k=3)
    assert rec.table[0][2] == 3 and rec.predicted[1] == pytest.approx(predicted_speedup(served, lookup, 1, 3))
    assert rec.plain_from is not None and all(rec.speculates_at(b) == (b < rec.plain_from) for b in range(1, 9))
    assert all(rec.predicted[b] == 1.0 for b in range(rec.plain_from, 9))
    assert all(predicted_speedup(served, lookup, b, k) < 1.03 for b in range(rec.plain_from, 9) for k in range(4))
    assert rec.table[-1] == (rec.plain_from, 8, 0)  # the speculative server, if loaded past it, drafts nothing
    never = Acceptance((0.05,), 1.0, 1.0, draft_forwards=False)
    assert deployable(served, never, 8, max_k=1).plain_from == 1  # nothing pays: plain serving throughout


def test_a_profile_keeps_its_served_costs_and_says_how_it_measured(tmp_path):
    profile = Profile("m", None, "cpu", "float32", 0.02, {1: 1.0}, None, batch_cost={1: {1: 1.0}})
    data = {**profile.as_dict(), "served": COSTS.as_dict(), "how": {"served": "closed loop"}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    view = read_profile(tmp_path / "p.json")
    assert view.served == COSTS


def test_a_level_takes_the_prefill_round_out_of_the_full_round_over_the_decode_steps(monkeypatch):
    """Scripted rounds: a prefill round of 0.1 s and a full one of 1.1 s over 50 decode steps give a
    20 ms step; the forced drafter's levels lead each prompt with its length's code and share one
    prefill round per C."""
    sent = []

    def scripted(url, bodies, c):
        sent.append(bodies)
        one = bodies[0]["max_tokens"] == 1
        answer = Completion([1], [7] * (1 if one else 51), "", "length", 0.0, None)
        return (0.1 if one else 1.1), [answer] * len(bodies)

    monkeypatch.setattr(served_levels, "round_seconds", scripted)
    got = served_levels.server_levels("url", "m", [[1, 2, 3], [4, 5]], (1, 2), 51, "plain", None)
    assert got[1] == Level(0.02, 0.1, 2.5, 50.0) and got[2].step_s == pytest.approx(0.02)
    assert all(b["ignore_eos"] for bodies in sent for b in bodies) and len(sent[1]) == 4  # whole rounds, ≥ 4
    sent.clear()
    forced = served_levels.forced_levels("url", "m", [[1, 2, 3]], (2,), 51, (0, 2), None)
    assert sorted(forced) == [1, 3] and forced[3][2].step_s == pytest.approx(0.02)
    assert [bodies[0]["max_tokens"] for bodies in sent] == [1, 51, 51]  # one prefill round for both lengths
    assert [bodies[0]["prompt"][0] for bodies in sent] == [CODE_BASE, CODE_BASE, CODE_BASE + 2]


def test_the_deploy_tab_draws_plain_serving_from_the_crossover_and_tells_why_in_a_worked_example(tmp_path):
    from mtp_viz.ui.deploy_tab import serving_views

    folder = tmp_path / "sweep"
    folder.mkdir()
    common = {"new_tokens": 196, "requests": 4, "prompt_tokens": 200.0, "tokens_per_s": 10.0}
    lookup = {
        "mean_accepted_tokens": 196 / 100,
        "scored_per_forward": 3.88,
        "per_position_acceptance": "[0.9, 0.8, 0.7]",
    }
    rows = [
        {
            "strategy": "autoregressive",
            "concurrency": c,
            "speedup": 1.0,
            "mean_accepted_tokens": 1.0,
            "scored_per_forward": 1.0,
            "per_position_acceptance": "[]",
            **common,
        }
        for c in (1, 8)
    ]
    rows += [
        {"strategy": "prompt_lookup", "concurrency": c, "speedup": s, **lookup, **common}
        for c, s in ((1, 1.5), (8, 0.8))
    ]
    pd.DataFrame(rows).to_csv(folder / "serving.csv", index=False)  # fmt: skip
    (folder / "summary.json").write_text(json.dumps({"machine": {"cpu": "Serving CPU"}, "vllm": "9.9", "prompts": []}))
    profile = Profile("m", None, "cpu", "float32", 0.02, {1: 1.0}, None, batch_cost={1: {1: 1.0}, 8: {1: 1.0}})
    data = {**profile.as_dict(), "engine": "vllm", "machine": {"engine": "vllm", "vllm": "9.9", "cpu": "Engine CPU"}}
    data |= {"served": COSTS.as_dict(), "step_fit": {"fixed_s": 0.015, "per_sequence_s": 0.0, "per_token_s": 0.0015}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    fig, shown, schedules, caption = serving_views(folder, tmp_path / "p.json")
    plain_from = schedules.set_index("strategy").loc["prompt_lookup", "plain serving from B"]
    assert 1 < plain_from <= 8
    assert any(f"prompt_lookup: plain from {plain_from}" in a.text for a in fig.layout.annotations)
    assert "Worked example: prompt_lookup" in caption and "15.0 ms on every step" in caption
    assert f"from **{plain_from}** concurrent sequences plain serving" in caption
    assert "accepted at 0.90, 0.80, 0.70" in caption and "2.00 tokens a sequence and scored 4.00" in caption


def test_a_fixed_length_variant_keeps_a_labels_other_settings():
    from mtp_viz.serving.scheduled import is_recommended, length_variant, recommended_label

    assert length_variant("prompt_lookup", 2) == "prompt_lookup:num_draft_tokens=2"
    assert length_variant("eagle:depth=3", 1) == "eagle:depth=1"
    assert length_variant("prompt_lookup:max_ngram_size=2:num_draft_tokens=3", 1) == (
        "prompt_lookup:max_ngram_size=2:num_draft_tokens=1"
    )
    assert is_recommended(recommended_label("eagle:depth=3")) and not is_recommended("eagle:depth=3")


def lookup_sweep(**extra) -> pd.DataFrame:
    """A prompt-lookup row: 49 tokens a request, 2 a decode step, 3 drafts (the prediction test's)."""
    row = {"strategy": "prompt_lookup", "concurrency": 1, "new_tokens": 196, "requests": 4, "prompt_tokens": 200.0,
           "mean_accepted_tokens": 1.96, "scored_per_forward": 3.88, "speedup": 1.5,
           "per_position_acceptance": "[1.0, 0.0, 0.0]"}  # fmt: skip
    return pd.DataFrame([row | extra])


def test_the_recommendation_prices_a_decode_step_as_the_rows_prediction_does():
    """auto_schedule with costs as served reads the row's acceptance per decode step (its forwards
    count the prefill's): the length the row ran with is predicted as the row is; a sweep without
    prompt lengths falls back to the lockstep model instead of failing; no B past the profile's."""
    from mtp_viz.profile import ProfileView
    from mtp_viz.serving.scheduled import auto_schedule, row_acceptance, step_costs

    lockstep = {1: {1: 1.0, 4: 1.2}, 8: {1: 1.0, 4: 4.0}}
    view = ProfileView({1: 1.0}, None, "m", lockstep, None, "vllm", {1: 0.02, 8: 0.04}, served=COSTS)
    table = lookup_sweep()
    rec = auto_schedule(table, view, "prompt_lookup", 3, 32)
    row_prediction = with_prediction(table, None, None, None, COSTS)["predicted_speedup"].iloc[0]
    assert rec.table[0][0] == 1 and max(b for _, b, _ in rec.table) <= 8  # the profile measured C up to 8
    request = served_request(table.iloc[0])
    costs = step_costs(view, "prompt_lookup", (request.tokens, request.prompt))
    acceptance = row_acceptance(table, "prompt_lookup", 3, request)
    assert predicted_speedup(costs, acceptance, 1, 3) == pytest.approx(row_prediction, rel=1e-6)
    per_forward = row_acceptance(table, "prompt_lookup", 3)  # what it read before: 1.96 a forward, not 2 a step
    assert predicted_speedup(costs, per_forward, 1, 3) < row_prediction * 0.995
    assert rec.predicted[1] >= row_prediction * (1 - 1e-6)  # its best length is at least the one the row ran
    older = auto_schedule(table.drop(columns="prompt_tokens"), view, "prompt_lookup", 3, 32)
    assert older.predicted[1] > 0  # the lockstep model: a number, not a KeyError


def test_a_load_between_two_that_pay_is_not_left_speculating_below_plain(monkeypatch):
    from mtp_viz import schedule

    gains = {1: 1.10, 2: 0.97, 3: 1.05, 4: 0.90}
    monkeypatch.setattr(schedule, "recommend", lambda *a: ((1, 4, 3),))
    monkeypatch.setattr(schedule, "predicted_speedup", lambda costs, acc, b, k: gains[b] if k else 1.0)
    rec = schedule.deployable(None, None, 4)
    assert rec.plain_from == 2 and all(v >= 1.0 for v in rec.predicted.values())
    gains.update({2: 1.2})  # now B = 1..3 all pay: plain from 4
    assert schedule.deployable(None, None, 4).plain_from == 4
