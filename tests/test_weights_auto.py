"""`--weights auto` (mtp_viz.weights_auto): the fastest format that stays close to fp32, measured
once per machine and model, and said."""

import pytest

from mtp_viz import weights_auto
from mtp_viz.weights import BF16, FP32, INT8, Q4
from mtp_viz.weights_auto import AGREEMENT_FLOOR, choose

STEADY = [1.0, 1.0, 1.01, 0.99, 1.0]


def times(**ms: float) -> dict[str, list[float]]:
    return {fmt: [t * ms_ for t in STEADY] for fmt, ms_ in ms.items()}


def test_the_fastest_format_that_agrees_enough_wins():
    agreement = {BF16: 0.999, INT8: 0.995, Q4: AGREEMENT_FLOOR - 0.001}
    assert choose(agreement, times(fp32=30, bf16=20, int8=15, q4=10)) == (INT8, True)
    assert choose({**agreement, Q4: AGREEMENT_FLOOR}, times(fp32=30, bf16=20, int8=15, q4=10)) == (Q4, True)


def test_fp32_wins_when_it_is_fastest_or_nothing_agrees():
    assert choose({BF16: 0.999}, times(fp32=10, bf16=20)) == (FP32, True)
    assert choose({BF16: 0.5, Q4: 0.5}, times(fp32=30, bf16=10, q4=5)) == (FP32, True)


def test_a_noisy_comparison_decides_nothing():
    noisy = times(fp32=30, q4=10)
    noisy[Q4] = [10, 30, 10, 25, 12]
    assert choose({Q4: 1.0}, noisy) == (FP32, False)


def test_auto_measures_once_records_why_and_reuses_it(use_tiny_registry, tmp_path, monkeypatch):
    from mtp_viz.loading import load_model
    from mtp_viz.runner import RunRequest, run
    from mtp_viz.strategies.base import GenerationSettings

    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path))
    monkeypatch.setattr(weights_auto, "PROMPTS", 2)
    monkeypatch.setattr(weights_auto, "NEW_TOKENS", 6)
    loaded = load_model("tiny", weights="auto")
    chosen = loaded.weights
    [record] = (tmp_path / "weights").glob("auto-*.json")
    data = weights_auto.read_record(record)
    assert data["chosen"] == chosen and set(data["formats"]) == {FP32, BF16, INT8, Q4}
    assert all(0.0 <= data["formats"][f]["agreement"] <= 1.0 for f in (BF16, INT8, Q4))
    assert data["load_average"] is not None and data["formats"][FP32]["forward_ms"] > 0
    # each format's row plan as measured when it loaded: lossless here (tests/test_row_plan.py: when not)
    assert all(
        data["formats"][f]["lossless"] and data["formats"][f]["rows"].startswith("rows: ") for f in data["formats"]
    )

    def fail(_load):
        raise AssertionError("measured twice")

    monkeypatch.setattr(weights_auto, "measure", fail)
    trace = run(RunRequest(prompt="the cat", model="tiny", weights="auto", generation=GenerationSettings(3)))
    assert trace.settings["weights"] == "auto" and trace.machine["weights"].split()[0] == chosen
    assert trace.machine["weights_choice"] == loaded.weights_why and chosen in trace.machine["weights_choice"]


@pytest.mark.parametrize("fmt", [BF16, INT8, Q4])
def test_quality_of_a_format_against_itself_is_perfect(fmt, use_tiny_registry):
    from mtp_viz.loading import load_model

    model = load_model("tiny", weights=fmt)
    scores = weights_auto.quality(model, {fmt: model}, ["the cat sat", "def add"], new_tokens=5)
    assert scores[fmt]["agreement"] == 1.0 and scores[fmt]["positions"] == 10
