"""The speculation schedule (mtp_viz.schedule): pure functions on hand-made step costs, the
table in vLLM's form, and the serving engine's step-cost fit."""

import importlib.util
import json

import pandas as pd
import pytest
from optional import require

from mtp_viz.errors import UserError
from mtp_viz.profile import ProfileView
from mtp_viz.schedule import (
    Acceptance,
    StepCosts,
    best_length,
    checked,
    crossover,
    format_table,
    length_at,
    measured_acceptance,
    parse_table,
    predicted_speedup,
    recommend,
    to_vllm,
)
from mtp_viz.serving.engine_profile import fit_step
from mtp_viz.serving.in_vllm.forced_drafts import CODE_BASE, ForcedDrafts, draft_length
from mtp_viz.serving.scheduled import auto_schedule, scheduled_label, split_label
from mtp_viz.serving.server import VLLM_VENV

CHEAP = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 6: 1.5, 8: 2.0}  # a step that barely grows with its rows
LINEAR = {k: float(k) for k in CHEAP}  # every verified token as dear as a step: speculation never pays
LOOKUP = Acceptance(positions=(0.8, 0.6, 0.45), drafting=1.0, fill=1.0, draft_forwards=False)
VLLM_UTILS = "lib/python*/site-packages/vllm/v1/spec_decode/dynamic/utils.py"  # vLLM's schedule lookup, in .venv-vllm


def costs(cheap_up_to: int = 7, sizes=range(1, 9)) -> StepCosts:
    return StepCosts({b: CHEAP if b <= cheap_up_to else LINEAR for b in sizes})


def test_three_drafts_win_alone_and_none_from_eight_sequences():
    table = recommend(costs(), LOOKUP, max_batch=32)
    assert best_length(costs(), LOOKUP, 1) == 3  # 2.85 tokens for 1.06 of a step; 4 drafts: 3.19 for 1.28
    assert table == ((1, 7, 3), (8, 32, 0))
    assert crossover(table) == 8
    assert to_vllm(table) == [[1, 7, 3], [8, 32, 0]]


def test_a_schedule_that_always_pays_has_no_crossover_and_lengths_carry_past_the_table():
    table = recommend(costs(cheap_up_to=99), LOOKUP, max_batch=16)
    assert table == ((1, 16, 3),) and crossover(table) is None
    assert length_at(table, 64) == 3 and length_at(((1, 2, 3), (3, 8, 1)), 5) == 1


def test_a_drafter_forward_per_token_shortens_the_draft():
    dear = StepCosts(costs().batch_cost, draft_cost={b: 0.5 for b in range(1, 9)})
    drafted = Acceptance((0.8, 0.6, 0.45), 1.0, 1.0, draft_forwards=True)
    assert best_length(dear, drafted, 1) == 1  # 1.8 / (1.02 + 0.5) beats 2.4 / (1.04 + 1.0)
    assert predicted_speedup(dear, drafted, 1, 0) == 1.0
    with pytest.raises(UserError, match="no draft cost"):
        predicted_speedup(costs(), drafted, 1, 2)


def test_between_measured_batch_sizes_the_step_is_weighed_by_its_seconds():
    two = StepCosts({1: CHEAP, 8: LINEAR}, one_token_s={1: 0.05, 8: 0.35})
    mid = two.relative(4, 4)  # 3/7 of the way from B = 1 to 8, weighted by each step's time
    weight = 3 / 7
    expected = ((1 - weight) * 0.05 * 1.06 + weight * 0.35 * 4) / ((1 - weight) * 0.05 + weight * 0.35)
    assert mid == pytest.approx(expected) and two.relative(32, 4) == 4.0


def test_measured_acceptance_reproduces_the_run_it_came_from_and_extends_geometrically():
    acc = measured_acceptance(1.3, 2.2, [0.57, 0.41, 0.34], k=3, draft_forwards=False)
    assert acc.tokens(3) == pytest.approx(1.3) and acc.scored(3) == pytest.approx(2.2)
    assert acc.rate(4) == pytest.approx(0.34 * 0.34 / 0.41) and acc.tokens(0) == 1.0
    assert acc.scored(1) == pytest.approx(1.4)


def test_tables_round_trip_through_text_and_vllms_form():
    table = ((1, 2, 3), (3, 8, 1), (9, 32, 0))
    assert format_table(table) == "1-2:3,3-8:1,9-32:0"
    assert parse_table(format_table(table)) == table
    assert parse_table(json.dumps(to_vllm(table))) == table
    assert checked(to_vllm(table)) == table


@pytest.mark.parametrize(
    "text, why",
    [("2-8:3", "starts at batch size 1"), ("1-4:3,3-8:1", "overlap"), ("1-4:-1", "draft tokens >= 0"), ("x", "not")],
)
def test_tables_vllm_would_refuse_are_refused_here(text, why):
    with pytest.raises(UserError, match=why):
        parse_table(text)


def test_vllms_own_lookup_reads_our_table_as_we_do():
    found = next(VLLM_VENV.glob(VLLM_UTILS), None)  # the repository's .venv-vllm, wherever pytest runs
    require(found is not None, "vLLM (.venv-vllm) with its dynamic schedule", "bash scripts/setup.sh --vllm")
    spec = importlib.util.spec_from_file_location("vllm_dynamic_sd_utils", found)
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)  # the file imports nothing: its functions run here as in vLLM
    table = ((1, 2, 3), (3, 8, 1), (9, 16, 0))
    dense = utils.build_dynamic_sd_schedule_lookup(
        to_vllm(table), vllm_max_batch_size=64, vllm_num_speculative_tokens=3
    )
    assert [dense[b] for b in range(1, 65)] == [length_at(table, b) for b in range(1, 65)]


def test_the_step_fit_separates_the_fixed_cost_from_the_rows():
    steps = {b: {k: 0.04 + 0.002 * b + 0.001 * b * k for k in (1, 2, 4, 8)} for b in (1, 4, 16)}
    fit = fit_step(steps)
    assert fit["fixed_s"] == pytest.approx(0.04) and fit["per_sequence_s"] == pytest.approx(0.002)
    assert fit["per_token_s"] == pytest.approx(0.001)


def test_the_forced_drafter_proposes_exactly_what_each_request_asks_for():
    class Config:
        class speculative_config:
            num_speculative_tokens = 5

    drafter = ForcedDrafts(Config)
    rows = [[CODE_BASE + 3, 9, 9], [CODE_BASE + 9, 9, 9], [17, 9, 9], [CODE_BASE, 9, 9]]
    drafts = drafter.propose([[11], [12], [13], []], None, rows)
    assert drafts == [[11, 11, 11], [], [], []]  # 9 is over the server's 5: not a code; [] still prefilling
    assert draft_length(CODE_BASE + 5, 5) == 5 and draft_length(CODE_BASE - 1, 5) == 0


def test_auto_schedules_from_a_sweeps_measured_acceptance():
    view = ProfileView({}, None, "vLLM", {b: CHEAP if b < 8 else LINEAR for b in (1, 2, 4, 8, 16, 32)}, None)
    row = {"strategy": "prompt_lookup", "concurrency": 1, "mean_accepted_tokens": 2.85, "scored_per_forward": 4.0}
    sweep = pd.DataFrame([{**row, "per_position_acceptance": json.dumps([0.8, 0.6, 0.45])}])
    rec = auto_schedule(sweep, view, "prompt_lookup", 3, 32)
    table = rec.table
    # from 8 sequences no length pays; at 7 (between cheap 4 and linear 8) none pays by the 3% margin
    assert table[0][:1] + table[0][2:] == (1, 3) and table[-1] == (7, 32, 0) and crossover(table) == 7
    assert rec.plain_from == 7 and rec.predicted[7] == 1.0 and rec.predicted[1] > 1.5
    label = scheduled_label("prompt_lookup", table)
    assert split_label(label) == ("prompt_lookup", table) and split_label("prompt_lookup") == ("prompt_lookup", None)
