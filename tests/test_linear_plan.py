"""The linear plan (mtp_viz.linear_plan) is chosen from timings: fast only where it clearly wins,
stock where it does not or where the timings are too noisy to tell. A noisy bucket is measured
again, a bucket still noisy stays on stock and the plan is measured again later, and every cached
plan says when and how it was measured. Timings are scripted: nothing here depends on the clock."""

import itertools
import json
import logging
import os
from datetime import UTC, datetime, timedelta

import pytest
import torch
from torch import nn

from mtp_viz import kernels, linear_plan
from mtp_viz.cli import main
from mtp_viz.kernel_plan import machine_records, plan_path, read_record, remeasure, tune
from mtp_viz.kernels import FAST, FIXED_PLAN, MAX_ROWS, STOCK, STOCK_PLAN, Plan, plan_of
from mtp_viz.linear_plan import (
    BY_APP,
    BY_COMMAND,
    BY_LOAD,
    MAX_SPREAD,
    MEASURED_ROWS,
    RETRIES,
    RETRY_AFTER_S,
    Stopped,
    choose,
    describe_record,
    measure,
    noisy,
    spread,
)
from mtp_viz.weights import BF16, FP32, INT8, Q4

ROWS = (1, 2, 4, 8)
BUSY = [45.0, 130.0, 39.0, 72.0, 60.0]  # stock at 2 rows during a package install (the case): 3x apart
BUSY_FAST = [5.0, 50.0, 6.0, 44.0, 7.0]  # the fast way in the same rounds: some of them slower than stock's best


def timings(stock: dict[int, float], fast: dict[int, float], rounds: int = 5, jitter=None):
    """Timings as `measure` returns them; `jitter(way, rows, round)` adds per-round noise."""
    jitter = jitter or (lambda way, rows, i: 0.0)
    out = {}
    for way, table in ((STOCK, stock), (FAST, fast)):
        for rows, t in table.items():
            out[way, rows] = [t + jitter(way, rows, i) for i in range(rounds)]
    return out


class Script:
    """A measure_fn: steady timings for the buckets asked (fast wins everywhere, most at 2 rows),
    except the rounds of the buckets `noisy[i]` names on the i-th call, which are BUSY (stock) and
    BUSY_FAST (fast): rounds that overlap, so the bucket cannot tell."""

    def __init__(self, *noisy: set[int]):
        self.noisy = noisy
        self.asked: list[list[int]] = []

    def __call__(self, model, rows):
        call = len(self.asked)
        self.asked.append(list(rows))
        busy = self.noisy[call] if call < len(self.noisy) else set()
        out = {}
        for r in rows:
            out[STOCK, r] = list(BUSY) if r in busy else [10.0 + r] * 5
            out[FAST, r] = list(BUSY_FAST) if r in busy else [5.0 if r == 2 else 0.8 * (10.0 + r)] * 5
        return out


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    monkeypatch.setenv(kernels.ENV, kernels.AUTO)
    return tmp_path


# --- the choice ------------------------------------------------------------------------------


def test_fast_wins_everywhere_and_pads_to_the_cheapest_measured_count():
    padded = choose(timings({1: 10, 2: 20, 4: 30, 8: 50}, {1: 8, 2: 6, 4: 7, 8: 20}))
    assert padded[1] == 2 and padded[2] == 2  # 2 rows cost less than 1 the fast way
    assert padded[3] == padded[4] == 4
    assert all(padded[r] == 8 for r in range(5, 9))
    assert all(p == 0 for p in padded[9:])  # nothing measured beyond 8: stock
    assert padded[0] == 0


def test_stock_wins_everywhere():
    assert set(choose(timings({1: 5, 2: 6, 4: 7, 8: 9}, {1: 9, 2: 9, 4: 9, 8: 12}))) == {0}


def test_mixed_by_row_count():
    padded = choose(timings({1: 10, 2: 11, 4: 12, 8: 30}, {1: 14, 2: 15, 4: 16, 8: 20}))
    assert padded[1:5] == (0, 0, 0, 0)
    assert padded[5:9] == (8, 8, 8, 8)


def test_a_win_inside_the_margin_or_the_noise_goes_to_stock():
    # 3% faster: inside the margin
    assert set(choose(timings({1: 10, 2: 10}, {1: 9.7, 2: 9.7}))) == {0}
    # 20% faster in the median, but slower in 2 of 5 rounds: too noisy to tell
    noisy = timings({1: 10}, {1: 8}, jitter=lambda way, rows, i: 5.0 if (way, i) in ((FAST, 0), (FAST, 1)) else 0.0)
    assert choose(noisy)[1] == 0
    # the same win, steady in every round: fast
    assert choose(timings({1: 10}, {1: 8}))[1] == 1


def test_a_noisy_bucket_decides_nothing():
    steady = timings({1: 10, 2: 20, 4: 30}, {1: 8, 2: 6, 4: 25})
    assert choose(steady)[1:3] == (2, 2)
    # on a busy machine the fast way looks 9x faster at 2 rows in the median, but two of its rounds
    # were slower than stock's best: the bucket cannot tell
    busy = {**steady, (STOCK, 2): BUSY, (FAST, 2): BUSY_FAST}
    assert noisy(busy, 2)
    padded = choose(busy)
    assert padded[2] == 0  # its own rows stay on stock
    assert padded[1] == 1  # and 1 row no longer pads to it
    assert padded[3] == padded[4] == 4  # the steady buckets keep their choice


def test_a_clear_cut_win_decides_however_its_rounds_spread():
    """The output head on a quiet 2-core EPYC (ms a round, measured): the padded product at 2 rows
    spreads 0.48 but beats stock in every round by 4x; counting that as noise cost 3x on the head."""
    measured = {
        (STOCK, 1): [11.4, 11.1, 11.1, 11.1, 11.2],
        (FAST, 1): [11.3, 11.2, 10.9, 12.5, 10.8],
        (STOCK, 2): [25.1, 24.7, 24.7, 26.2, 25.9],
        (FAST, 2): [3.5, 3.6, 5.6, 4.3, 6.8],
    }
    assert spread(measured[FAST, 2]) > MAX_SPREAD and not noisy(measured, 2)
    assert choose(measured)[1:3] == (2, 2)  # one row pads to two: 3.5-6.8 ms against 11.1-11.4
    # a spread-out fast bucket pads a smaller row count only where it wins every round there too
    closer = {**measured, (STOCK, 1): [7.0, 7.0, 7.0, 7.0, 6.0]}  # wins 4 of 5 rounds, not every one
    assert choose(closer)[1] == 0 and choose(closer)[2] == 2


def test_spread_is_the_interquartile_range_over_the_median():
    assert spread([10.0] * 5) == 0.0
    assert spread([10.0, 10.0, 10.0, 10.0, 30.0]) == 0.0  # one outlier in five moves nothing
    assert spread([10.0, 10.0, 10.0, 30.0, 30.0]) > MAX_SPREAD  # two do
    assert spread(BUSY) > MAX_SPREAD
    assert spread([45.0, 130.0, 39.0, 72.0]) > MAX_SPREAD  # the four rounds as recorded
    assert spread([10.0, 11.0]) == float("inf")  # too few rounds to tell


def test_plan_describes_itself():
    assert STOCK_PLAN.describe() == "stock"
    plan = Plan(tuple([0, 2, 2, 4, 4, 5] + [0] * (MAX_ROWS - 5)))
    assert plan.describe() == f"fast 1-2→2, 3-4→4, 5; stock 6-{MAX_ROWS}"


# --- measuring ---------------------------------------------------------------------------------


def test_measure_interleaves_both_ways_round_by_round():
    def passes():  # the k-th timed pass lasts k + 1 ticks, so each timing says when its pass ran
        t = 0.0
        for k in itertools.count():
            yield t
            t += k + 1
            yield t

    rows, rounds = (1, 3), 4
    result = measure([torch.randn(8, 4)], rows=rows, rounds=rounds, clock=passes().__next__)
    assert set(result) == {(STOCK, 1), (FAST, 1), (STOCK, 3), (FAST, 3)}
    order = {key: [int(t) - 1 for t in ts] for key, ts in result.items()}  # pass index of each round
    assert min(min(ks) for ks in order.values()) == 2 * len(rows)  # the warm-up round is dropped
    for i in range(rounds):
        for r in rows:
            assert abs(order[STOCK, r][i] - order[FAST, r][i]) == 1  # both ways back to back
        ran = sorted(ks[i] for ks in order.values())
        assert ran == list(range(ran[0], ran[0] + 2 * len(rows)))  # a round times every bucket before the next
    first = [STOCK if order[STOCK, 1][i] < order[FAST, 1][i] else FAST for i in range(rounds)]
    assert first == [STOCK, FAST, STOCK, FAST]  # which way goes first alternates


def test_measure_stops_when_asked():
    asked = itertools.count()
    with pytest.raises(Stopped):
        measure([torch.randn(8, 4)], rows=(1,), rounds=3, stopped=lambda: next(asked) >= 2)


def test_a_noisy_bucket_is_measured_again_until_it_settles(cache):
    script = Script({2}, {2})  # busy for the first two tries of 2 rows, then quiet
    result = remeasure(nn.Sequential(nn.Linear(4, 8)), BY_LOAD, measure_fn=script)
    assert script.asked == [list(MEASURED_ROWS), [2], [2]]  # only the noisy bucket again, all rounds anew
    assert result.tries[2] == 3 and result.tries[1] == 1
    assert result.noisy_rows == [] and result.plan.padded[1] == 2  # settled: its win counts
    assert result.record()["settled"] is True


def test_a_bucket_still_noisy_stays_on_stock_and_the_plan_is_measured_again_later(cache, caplog):
    model = nn.Sequential(nn.Linear(4, 8))
    script = Script(*[{2}] * (RETRIES + 1))
    with caplog.at_level(logging.WARNING, logger="mtp_viz.linear_plan"):
        plan = tune(model, measure_fn=script)
    assert len(script.asked) == RETRIES + 1  # bounded
    assert plan.padded[2] == 0 and plan.padded[1] == 1 and plan.padded[3] == 3  # the others keep theirs
    record = read_record(plan_path(model))
    assert record["settled"] is False and record["noisy_rows"] == [2]
    assert record["buckets"]["2"]["choice"] == "stock (noisy)" and record["buckets"]["2"]["tries"] == RETRIES + 1
    said = [m for m in caplog.messages if "too noisy" in m]
    assert len(said) == 1 and "\n" not in said[0] and "rows 2 " in said[0] and BY_COMMAND in said[0]

    assert tune(model, measure_fn=script).padded == plan.padded and len(script.asked) == RETRIES + 1  # kept a while ...
    aged = datetime.now(UTC) - timedelta(seconds=RETRY_AFTER_S + 60)
    plan_path(model).write_text(json.dumps({**record, "measured_at": aged.isoformat()}))
    again = tune(model, measure_fn=script)  # ... then measured again: quiet now, so 2 rows go fast
    assert len(script.asked) == RETRIES + 2 and again.padded[2] == 2
    assert read_record(plan_path(model))["settled"] is True


def test_a_busy_machine_is_not_measured_again_and_gets_stock(cache):
    script = Script(set(MEASURED_ROWS))  # every bucket noisy: something else uses the CPU
    result = remeasure(nn.Sequential(nn.Linear(4, 8)), BY_LOAD, measure_fn=script)
    assert len(script.asked) == 1  # retrying would only take longer
    assert result.noisy_rows == list(MEASURED_ROWS) and result.plan.padded == STOCK_PLAN.padded


def test_modes_and_the_cache(cache):
    model = nn.Sequential(nn.Linear(4, 8))
    script = Script()
    os.environ[kernels.ENV] = STOCK  # the fixture restores it
    assert tune(model, measure_fn=script) is STOCK_PLAN
    os.environ[kernels.ENV] = FAST
    assert tune(model, measure_fn=script) is FIXED_PLAN
    assert script.asked == []
    os.environ[kernels.ENV] = kernels.AUTO
    first = tune(model, measure_fn=script)
    assert first.source == "measured" and first.padded[2] == 2 and len(script.asked) == 1
    again = tune(model, measure_fn=script)  # a later load: from the cache, nothing timed
    assert again.source == "cached" and again.padded == first.padded and len(script.asked) == 1
    tune(nn.Sequential(nn.Linear(4, 16)), measure_fn=script)  # other shapes: measured anew
    assert len(script.asked) == 2


def test_a_load_reads_the_record_once_measures_what_is_missing_and_writes_once(cache, monkeypatch):
    """The kernel plan is one pass (mtp_viz.kernel_plan): both halves in one record, read once a
    load; a first load measures both and writes once, a later one measures and writes nothing."""
    from mtp_viz import measured, row_plan

    reads, writes = [], []
    monkeypatch.setattr(measured, "read_raw", _counting(measured.read_raw, reads))
    monkeypatch.setattr(measured, "write", _counting(measured.write, writes))
    model = nn.Sequential(nn.Linear(4, 8))
    plan = tune(model, measure_fn=Script())
    assert (len(reads), len(writes)) == (1, 1) and plan.source == "measured"
    record = json.loads(plan_path(model).read_text())
    assert record["padded"] == list(plan.padded) and set(record["rows"]) == {"fp32 (" + plan.describe() + ")"}
    monkeypatch.setattr(row_plan, "measure", lambda *a, **k: pytest.fail("row plans probed again"))
    again = tune(nn.Sequential(nn.Linear(4, 8)), measure_fn=lambda *a: pytest.fail("linear path timed again"))
    assert (len(reads), len(writes)) == (2, 1) and again.source == "cached"


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return counted


def test_the_record_says_when_and_how_it_was_measured(cache, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.25, 1.0))
    model = nn.Sequential(nn.Linear(4, 8))
    tune(model, measure_fn=Script())
    record = read_record(plan_path(model))
    assert datetime.fromisoformat(record["measured_at"]).tzinfo is not None
    assert record["by"] == BY_LOAD and record["load_average"] == [3.5, 2.25, 1.0]
    machine = record["machine"]
    assert machine["cpu"] and machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__
    assert record["rounds"] == linear_plan.ROUNDS and record["max_spread"] == MAX_SPREAD
    assert list(record["buckets"]) == [str(r) for r in MEASURED_ROWS]
    two = record["buckets"]["2"]
    assert two == {
        "stock_ms": 12000.0,
        "stock_spread": 0.0,
        "fast_ms": 5000.0,
        "fast_spread": 0.0,
        "tries": 1,
        "choice": "fast",
    }  # scripted seconds, recorded in ms
    assert record["buckets"]["1"]["choice"] == "fast, padded to 2"
    line = describe_record(record)
    assert record["measured_at"] in line and "load 3.5 on" in line and "by first load" in line and "noisy" not in line


@pytest.mark.parametrize("drop", [None, "load_average", "buckets", "measured_at"])
def test_an_old_plan_or_one_without_how_it_was_measured_is_measured_again(cache, drop):
    model = nn.Sequential(nn.Linear(4, 8))
    plan_path(model).parent.mkdir(parents=True)
    if drop is None:  # version 1: the plan and its timings only
        old = {"version": 1, "padded": list(FIXED_PLAN.padded), "describe": "fast", "timings_ms": {}}
    else:
        old = remeasure(model, BY_LOAD, write=False, measure_fn=Script()).record()
        del old[drop]
    plan_path(model).write_text(json.dumps(old))
    script = Script()
    plan = tune(model, measure_fn=script)
    assert plan.source == "measured" and len(script.asked) == 1


def test_remeasure_measures_whatever_the_mode_and_a_dry_run_writes_nothing(cache):
    model = nn.Sequential(nn.Linear(4, 8))
    os.environ[kernels.ENV] = STOCK
    result = remeasure(model, BY_COMMAND, write=False, measure_fn=Script())
    assert result.plan.padded[2] == 2 and not plan_path(model).exists()
    remeasure(model, BY_COMMAND, measure_fn=Script())
    assert read_record(plan_path(model))["by"] == BY_COMMAND
    assert [r["by"] for r in machine_records()] == [BY_COMMAND]


# --- the command and the app -------------------------------------------------------------------


def scripted_measure(weights, rows, rounds, stopped=None):
    return Script()(None, rows)


def test_the_tune_command_prints_the_table_and_caches_unless_a_dry_run(cache, use_tiny_registry, monkeypatch, capsys):
    from mtp_viz.loading import load_model

    monkeypatch.setattr(linear_plan, "measure", scripted_measure)
    assert main(["tune", "--model", "tiny", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rows"])
    assert [line.split()[0] for line in lines[header + 1 : header + 1 + len(MEASURED_ROWS)]] == list(
        map(str, MEASURED_ROWS)
    )
    assert "dry run" in printed and machine_records() == []
    assert os.environ[kernels.ENV] == kernels.AUTO  # the load's override is undone

    assert main(["tune", "--model", "tiny"]) == 0
    (record,) = [r for r in machine_records() if r["by"] == BY_COMMAND]  # the formats' heads have their own
    printed = capsys.readouterr().out
    assert "cached in" in printed and "row plans:" in printed
    assert all(f"  {fmt}: " in printed for fmt in (FP32, BF16, INT8, Q4))  # each format's row plan, measured again
    assert f"{FP32} ({record['describe']})" in record["rows"]  # beside the kernel plan, probed on it
    assert plan_of(load_model("tiny", "cpu", "float32").model).padded == tuple(record["padded"])
    assert main(["tune", "--model", "tiny", "--rounds", "2"]) == 2


def test_the_app_measures_again_and_switches_the_loaded_model(cache, use_tiny_registry, monkeypatch):
    from mtp_viz.loading import load_model
    from mtp_viz.ui.measure import remeasure_linear_plan
    from mtp_viz.ui.theory_tab import plans_note

    assert "No linear plan measured" in plans_note()
    monkeypatch.setattr(linear_plan, "measure", scripted_measure)
    *_, last = remeasure_linear_plan("tiny")
    (record,) = machine_records()
    assert record["by"] == BY_APP and last == describe_record(record)
    assert plan_of(load_model("tiny", "cpu", "float32").model).padded == tuple(record["padded"])
    note = plans_note()
    assert record["describe"] in note and BY_COMMAND in note
