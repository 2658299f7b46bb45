"""The architect's view: costs from the loaded models, B × k timings, the predicted speedup under
load, and the Deploy tab's table, CSV and figure (tiny models)."""

import json
import os

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from mtp_viz import profile
from mtp_viz.__main__ import main
from mtp_viz.deploy import DEPLOY_CONTEXT, concurrency_curves, cost_of, deploy_table, kv_cache_bytes
from mtp_viz.errors import InvalidSettingsError
from mtp_viz.loading import load_model
from mtp_viz.profile import batch_profile
from mtp_viz.theory import break_even, concurrency_speedup, interpolated
from mtp_viz.viz import figures

BATCH = {1: {1: 1.0, 2: 1.02, 4: 1.05}, 8: {1: 1.0, 2: 1.5, 4: 2.5}, 32: {1: 1.0, 2: 1.9, 4: 3.8}}


def test_concurrency_speedup_divides_tokens_by_what_the_forward_costs_at_each_load():
    curve = concurrency_speedup(
        tokens_per_forward=2.0, scored_per_forward=3.0, draft_forwards_per_forward=0.0, c=0.0, batch_cost=BATCH
    )
    assert curve[1] == pytest.approx(2.0 / 1.035) and curve[8] == pytest.approx(2.0 / 2.0)
    assert curve[32] == pytest.approx(2.0 / 2.85)
    assert break_even(curve) == 32  # 8 is exactly 1.0: not below
    with_draft = concurrency_speedup(2.0, 3.0, 2.0, 0.1, BATCH)
    assert with_draft[1] == pytest.approx(2.0 / (1.035 + 0.2))
    assert break_even({1: 1.2, 2: 1.1}) is None
    assert interpolated({1: 1.0, 4: 2.5}, 8) == pytest.approx(5.0)  # past the end: proportional
    with pytest.raises(InvalidSettingsError):
        concurrency_speedup(0.0, 1.0, 0.0, 0.0, BATCH)


def test_batch_profile_times_every_b_and_k_relative_to_one_token():
    model = tiny_model()
    cost, one = batch_profile(model, sizes=(1, 3), ks=(1, 2, 5), repeats=1, context=8)
    assert set(cost) == {1, 3} and all(set(row) == {1, 2, 5} for row in cost.values())
    assert all(t > 0 for t in one.values()) and all(v > 0 for row in cost.values() for v in row.values())


def test_batch_profile_takes_medians_over_rounds_then_divides_by_one_token(monkeypatch):
    """Scripted timings T(B, k) = B·(1 + (k−1)/2)·f, with f = 1, 3, 2 in the three rounds: the
    median round is f = 2, so T(B, 1) = 2B and the cost of k tokens is 1 + (k−1)/2."""
    rounds = {}

    class Timer:
        def __init__(self, model, b, context):
            self.b = b

        def time(self, k):
            n = rounds.setdefault((self.b, k), 0)
            rounds[self.b, k] = n + 1
            return self.b * (1 + (k - 1) / 2) * (1, 3, 2)[n]

    monkeypatch.setattr(profile, "_BatchTimer", Timer)
    cost, one = batch_profile(None, sizes=(1, 4), ks=(1, 3, 5), repeats=3)
    assert one == {1: 2.0, 4: 8.0}
    assert cost == {b: {1: 1.0, 3: 2.0, 5: 3.0} for b in (1, 4)}


def test_profile_command_records_b_by_k_timings_and_refuses_bad_sizes(use_tiny_registry, tmp_path, capsys):
    out = tmp_path / "p.json"
    common = ["profile", "--model", "tiny", "--max-k", "3", "--repeats", "1", "--exit-prompts", "0", "--out", str(out)]
    assert main([*common, "--batch-sizes", "1,2"]) == 0
    data = json.loads(out.read_text())
    assert set(data["batch_cost"]) == {"1", "2"} and set(data["batch_one_token_s"]) == {"1", "2"}
    assert main([*common, "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert main([*common, "--batch-sizes", ""]) == 0
    assert json.loads(out.read_text())["batch_cost"] is None


def _summary() -> pd.DataFrame:
    rows = [
        ("autoregressive", 1.0, 1.0, 1.0, 0.0),
        ("speculative:num_draft_tokens=2", 1.3, 1.8, 3.0, 2.0),
        ("prompt_lookup", 1.1, 1.3, 3.0, 0.0),
        ("hf_generate", 0.9, float("nan"), float("nan"), float("nan")),
    ]
    return pd.DataFrame(
        [
            {
                "category": "overall",
                "strategy": s,
                "speedup": sp,
                "tokens_per_s": 10 * sp,
                "mean_accepted_tokens": tok,
                "scored_per_forward": scored,
                "draft_forwards_per_forward": drafts,
                "identical_share": 1.0,
                "agreement": 1.0,
            }
            for s, sp, tok, scored, drafts in rows
        ]
    )


def test_deploy_table_puts_measured_speed_beside_costs_from_the_loaded_models(use_tiny_registry):
    table = deploy_table(_summary(), "tiny").set_index("strategy")
    assert "hf_generate" not in table.index  # peers are baselines, not deployments
    assert list(table.index) == ["speculative:num_draft_tokens=2", "prompt_lookup", "autoregressive"]
    target, draft = load_model("tiny"), load_model("tiny-draft")
    spec = table.loc["speculative:num_draft_tokens=2"]
    n = sum(p.numel() for p in draft.model.parameters())
    assert spec["extra_models"] == 1 and spec["extra_params"] == n
    expected_mb = (n * 4 + kv_cache_bytes(draft.model, DEPLOY_CONTEXT)) / 2**20
    assert spec["extra_memory_mb"] == pytest.approx(expected_mb, abs=1e-3)
    assert spec["target_forwards_per_token"] == pytest.approx(1 / 1.8, abs=1e-4)
    assert spec["draft_forwards_per_token"] == pytest.approx(2.0 / 1.8, abs=1e-4)
    lookup = table.loc["prompt_lookup"]
    assert lookup["extra_models"] == 0 and lookup["extra_params"] == 0 and lookup["training"] == "none"
    assert target.name == "tiny"


def test_concurrency_curves_and_their_figure_mark_where_speculation_stops_paying():
    summary = _summary()
    curves = concurrency_curves(summary, ["speculative:num_draft_tokens=2", "prompt_lookup", "hf_generate"], BATCH, 0.1)
    assert set(curves) == {"speculative:num_draft_tokens=2", "prompt_lookup"}  # the peer has no forwards
    speedups, below = curves["prompt_lookup"]
    assert speedups[1] > 1.0 and below == 8
    assert concurrency_curves(summary, ["speculative:num_draft_tokens=2"], BATCH, None) == {}  # c unknown
    fig = figures.concurrency(curves, "Some CPU")
    legend = [t for t in fig.data if t.showlegend is not False]
    assert len(legend) == 2 and "below 1x from 8 users" in legend[1].name
    assert any(t.marker.symbol == "x-thin" for t in fig.data)
    assert "Some CPU" in fig.layout.title.text


def test_deploy_tab_views_write_the_csv_and_name_the_machines(use_tiny_registry, tmp_path):
    from mtp_viz.profile import read_batch_profile
    from mtp_viz.ui.deploy_tab import views

    results = tmp_path / "summary.csv"
    _summary().to_csv(results, index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny", "machine": {"cpu": "Bench CPU"}, "rows": []}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"batch_cost": BATCH, "c": 0.1, "machine": {"cpu": "Profile CPU"}}))
    table, csv, fig, caption = views(results, profile)
    assert pd.read_csv(csv)["strategy"].tolist() == table["strategy"].tolist()
    assert "Bench CPU" in caption and "Profile CPU" in caption
    assert 1 <= len([t for t in fig.data if t.showlegend is not False]) <= figures.MAX_SERIES
    _, _, _, caption = views(results, None)
    assert "no B × k timings" in caption
    assert read_batch_profile(None)[0] is None


def _lossy_summary() -> pd.DataFrame:
    summary = _summary()
    lossy = [
        {"category": "overall", "strategy": "conf_adapt:mode=fixed:k=4", "speedup": 2.0, "agreement": 0.1},
        {"category": "overall", "strategy": "conf_adapt:tau=0.95", "speedup": 1.2, "agreement": 0.95},
    ]
    for row in lossy:
        row.update(tokens_per_s=10 * row["speedup"], mean_accepted_tokens=1.5, scored_per_forward=4.0)
        row.update(draft_forwards_per_forward=0.0, identical_share=0.0)
    return pd.concat([summary, pd.DataFrame(lossy)], ignore_index=True)


def test_lossy_variants_below_the_quality_floor_rank_last_and_leave_the_load_curve(use_tiny_registry, tmp_path):
    from mtp_viz.deploy import BELOW_FLOOR, LOSSLESS, within_floor
    from mtp_viz.ui.deploy_tab import views

    table = deploy_table(_lossy_summary(), "tiny")
    assert table["strategy"].iloc[-1] == "conf_adapt:mode=fixed:k=4"  # fastest, but garbage: last
    assert table.set_index("strategy").loc["conf_adapt:mode=fixed:k=4", "quality"] == BELOW_FLOOR
    assert table["strategy"].iloc[0] == "speculative:num_draft_tokens=2"
    assert table.set_index("strategy").loc["prompt_lookup", "quality"] == LOSSLESS
    assert deploy_table(_lossy_summary(), "tiny", floor=0.0)["strategy"].iloc[0] == "conf_adapt:mode=fixed:k=4"
    kept = set(within_floor(_lossy_summary())["strategy"])
    assert "conf_adapt:mode=fixed:k=4" not in kept and {"conf_adapt:tau=0.95", "hf_generate"} <= kept
    results = tmp_path / "summary.csv"
    _lossy_summary().to_csv(results, index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny", "machine": {"cpu": "X"}, "rows": []}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"batch_cost": BATCH, "c": 0.1, "machine": {"cpu": "Y"}}))
    names = lambda fig: " ".join(t.name or "" for t in fig.data)  # noqa: E731
    assert "conf_adapt:tau=0.95" in names(views(results, profile)[2])  # the family's best above the floor
    assert "fixed" not in names(views(results, profile)[2])
    assert "fixed" in names(views(results, profile, floor=0.0)[2])


def _sweep(folder, rows) -> None:
    folder.mkdir()
    columns = ["strategy", "concurrency", "tokens_per_s", "speedup", "mean_accepted_tokens", "scored_per_forward"]
    pd.DataFrame(rows, columns=columns).to_csv(folder / "serving.csv", index=False)
    (folder / "summary.json").write_text(
        json.dumps({"machine": {"cpu": "Serving CPU", "threads": 1}, "vllm": "9.9", "prompts": []})
    )


def test_serving_sweep_is_drawn_beside_the_prediction_with_its_error(tmp_path):
    from mtp_viz.errors import UserError
    from mtp_viz.ui.deploy_tab import serving_views

    rows = [
        ("autoregressive", 1, 20.0, 1.0, 1.0, 1.0),
        ("autoregressive", 8, 80.0, 1.0, 1.0, 1.0),
        ("prompt_lookup", 1, 24.0, 1.2, 1.3, 2.0),
        ("prompt_lookup", 8, 72.0, 0.9, 1.3, 2.0),
    ]
    _sweep(tmp_path / "sweep", rows)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"batch_cost": {1: {1: 1.0, 2: 1.0}, 8: {1: 1.0, 2: 1.3}}, "c": 0.1, "machine": {}}))
    fig, table, schedules, caption = serving_views(tmp_path / "sweep", profile)
    lookup = table[table["strategy"] == "prompt_lookup"].set_index("concurrency")
    assert lookup.loc[1, "predicted_speedup"] == pytest.approx(1.3) and lookup.loc[8, "predicted_speedup"] == 1.0
    assert lookup.loc[8, "prediction_error"] == pytest.approx((1.0 - 0.9) / 0.9, abs=1e-3)
    assert [t.name for t in fig.data] == ["prompt_lookup: measured", "prompt_lookup: predicted"]
    assert "Serving CPU, 1 threads, vLLM 9.9" in fig.layout.title.text and "Serving CPU" in caption
    with pytest.raises(UserError, match="not a serving sweep"):
        serving_views(tmp_path, profile)


def test_the_draft_cost_measured_on_the_engine_reproduces_its_single_client_speedup():
    from mtp_viz.serving.prediction import engine_draft_cost, with_prediction

    table = pd.DataFrame(
        [
            {"strategy": "speculative:num_draft_tokens=1", "concurrency": b, "speedup": sp, "tokens_per_s": 0.0}
            | {"mean_accepted_tokens": 1.25, "scored_per_forward": 2.0}
            for b, sp in ((1, 0.85), (8, 0.7))
        ]
    )
    batch = {1: {1: 1.0, 2: 1.0}, 8: {1: 1.0, 2: 1.4}}
    c = engine_draft_cost(table, batch)["speculative:num_draft_tokens=1"]
    assert c == pytest.approx(1.25 / 0.85 - 1.0)
    rows = with_prediction(table, batch, 0.1).set_index("concurrency")
    assert rows.loc[1, "calibrated_speedup"] == pytest.approx(0.85) and rows.loc[1, "calibrated_error"] == 0
    assert rows.loc[1, "predicted_speedup"] == pytest.approx(1.25 / 1.1)  # the profile's c = 0.1
    assert rows.loc[8, "calibrated_speedup"] == pytest.approx(1.25 / (1.4 + c))


def test_an_eagle_deployment_costs_its_drafter_and_its_one_layer_cache(use_tiny_registry, tmp_path):
    from mtp_viz.drafters.eagle3 import save_eagle3
    from mtp_viz.training.eagle import build_drafter

    target = load_model("tiny")
    drafter = build_drafter(target.model, (0, 1, 1), torch.arange(20))
    drafter.embed_tokens = None  # the target's, shared: not the drafter's cost
    save_eagle3(drafter, tmp_path / "eagle3")
    cost = cost_of("tiny", "eagle", str(tmp_path / "eagle3"), DEPLOY_CONTEXT, (0.5, 1.5))
    own = sum(p.numel() for p in drafter.parameters())
    c = drafter.config
    cache = 2 * c.num_key_value_heads * c.head_dim * DEPLOY_CONTEXT * 4
    assert cost.extra_models == 1 and cost.extra_params == own
    assert cost.extra_memory_mb == pytest.approx((own * 4 + cache) / 2**20, abs=1e-3)
    assert "EAGLE-3" in cost.training and cost.draft_forwards_per_token == 1.5


def _engine_profile(path, batch, draft_cost=None) -> None:
    data = {"batch_cost": batch, "c": None, "engine": "vllm", "machine": {"cpu": "Engine CPU", "threads": 1}}
    data["machine"] |= {"engine": "vllm", "vllm": "9.9"}
    path.write_text(json.dumps(data | {"draft_cost": draft_cost}))


def test_the_prediction_uses_the_engines_own_step_curve_and_drafter_cost_per_batch(tmp_path):
    from mtp_viz.ui.deploy_tab import serving_views

    rows = [("autoregressive", b, 20.0, 1.0, 1.0, 1.0) for b in (1, 8)]
    rows += [("speculative:num_draft_tokens=1", b, 20.0, sp, 1.25, 2.0) for b, sp in ((1, 0.9), (8, 0.7))]
    _sweep(tmp_path / "sweep", rows)
    profile = tmp_path / "profile.json"
    _engine_profile(profile, {1: {1: 1.0, 2: 1.05}, 8: {1: 1.0, 2: 1.4}}, {"speculative": {1: 0.3, 8: 0.5}})
    _, table, _, caption = serving_views(tmp_path / "sweep", profile)
    draft = table[table["strategy"] == "speculative:num_draft_tokens=1"].set_index("concurrency")
    assert draft.loc[1, "predicted_speedup"] == pytest.approx(1.25 / (1.05 + 0.3), abs=1e-3)
    assert draft.loc[8, "predicted_speedup"] == pytest.approx(1.25 / (1.4 + 0.5), abs=1e-3)
    assert draft["engine_c"].isna().all()  # the engine measured its own drafter: nothing to calibrate
    assert "Engine CPU, 1 threads, vLLM 9.9 steps" in caption and "measured" in caption


def test_the_deploy_tab_shows_the_recommended_schedule_and_the_served_one(tmp_path):
    from mtp_viz.ui.deploy_tab import serving_views

    cheap, linear = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 6: 1.5, 8: 2.0}, {k: float(k) for k in (1, 2, 3, 4, 6, 8)}
    served = "prompt_lookup:per_batch=1-7:3,8-32:0"
    rows = [("autoregressive", b, 20.0, 1.0, 1.0, 1.0) for b in (1, 8, 32)]
    rows += [("prompt_lookup", b, 20.0, 1.2, 2.85, 4.0) for b in (1, 8, 32)]
    rows += [
        (served, b, 20.0, sp, tok, sc)
        for b, sp, tok, sc in ((1, 1.2, 2.85, 4.0), (8, 1.0, 1.0, 1.0), (32, 1.0, 1.0, 1.0))
    ]
    _sweep(tmp_path / "sweep", rows)
    csv = tmp_path / "sweep" / "serving.csv"
    table = pd.read_csv(csv).assign(per_position_acceptance=json.dumps([0.8, 0.6, 0.45]))
    table.to_csv(csv, index=False)
    meta = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    meta["schedules"] = {
        served: {"from": "prompt_lookup", "num_speculative_tokens_per_batch_size": [[1, 7, 3], [8, 32, 0]]}
    }
    (tmp_path / "sweep" / "summary.json").write_text(json.dumps(meta))
    profile = tmp_path / "profile.json"
    _engine_profile(profile, {b: cheap if b < 8 else linear for b in range(1, 9)} | {32: linear})
    fig, shown, schedules, _ = serving_views(tmp_path / "sweep", profile)
    row = schedules.set_index("strategy").loc["prompt_lookup"]
    assert json.loads(row["num_speculative_tokens_per_batch_size"]) == [[1, 7, 3], [8, 32, 0]]
    assert row["speculation stops paying from B"] == 8 and row["served in this sweep as"] == served
    assert f"{served}: measured" in [t.name for t in fig.data] and f"{served}: predicted" in [t.name for t in fig.data]
    measured = shown[shown["strategy"] == served].set_index("concurrency")
    assert measured.loc[8, "predicted_speedup"] == 1.0 and measured.loc[1, "predicted_speedup"] > 2.0


def test_unverified_strategies_get_the_load_prediction_with_their_quality(use_tiny_registry, tmp_path):
    from mtp_viz.ui.deploy_tab import lossy_under_load

    results = tmp_path / "summary.csv"
    _lossy_summary().to_csv(results, index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny", "machine": {"cpu": "X"}, "rows": []}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"batch_cost": BATCH, "c": 0.1, "machine": {"cpu": "Y"}}))
    table = lossy_under_load(results, profile).set_index("strategy")
    assert set(table.index) == {"conf_adapt:mode=fixed:k=4", "conf_adapt:tau=0.95"}  # below the floor too
    assert table.loc["conf_adapt:mode=fixed:k=4", "agreement with autoregressive"] == 0.1
    assert {f"predicted, {b} users" for b in BATCH} <= set(table.columns)


def test_prefill_dilutes_a_decode_speedup_by_the_engines_cost_of_the_prompts():
    from mtp_viz.serving.prediction import with_prefill

    row = pd.Series({"concurrency": 8, "requests": 16, "new_tokens": 16 * 48, "prompt_tokens": 100.0})
    share = 8 * 100 * 0.001 / 0.2  # the 8 prompts' tokens at 1 ms each, in 200 ms one-token steps
    assert with_prefill(1.5, row, (0.001, {8: 0.2})) == pytest.approx((48 + share) / (48 / 1.5 + share))
    assert with_prefill(1.0, row, (0.001, {8: 0.2})) == 1.0  # plain decoding stays the baseline
    assert with_prefill(1.5, row.drop("prompt_tokens"), (0.001, {8: 0.2})) == 1.5  # an older sweep: decode only


def test_the_load_curves_take_a_serving_engines_drafter_cost_per_strategy_and_batch():
    summary = _summary()
    engine = {"speculative": {1: 0.3, 8: 0.5, 32: 0.5}}
    curves = concurrency_curves(summary, ["speculative:num_draft_tokens=2", "prompt_lookup"], BATCH, engine)
    speedups, _ = curves["speculative:num_draft_tokens=2"]
    assert speedups[1] == pytest.approx(1.8 / (interpolated(BATCH[1], 3.0) + 2.0 * 0.3))
    assert "prompt_lookup" in curves  # drafts nothing: no drafter cost needed
    assert concurrency_curves(summary, ["speculative:num_draft_tokens=2"], BATCH, {"eagle": {1: 0.1}}) == {}


def test_the_deploy_tables_read_rounded_and_their_csv_keeps_every_digit(use_tiny_registry, tmp_path, monkeypatch):
    """What a person reads: speedups and tokens per forward to 2 decimals, shares as %; the CSV
    has the measured figures as measured. A results file is priced once per version of it."""
    from mtp_viz.ui import deploy_tab
    from mtp_viz.ui.readable import readable

    summary = _lossy_summary()
    odd = summary["strategy"] == "conf_adapt:mode=fixed:k=4"
    summary.loc[odd, ["speedup", "agreement", "mean_accepted_tokens"]] = [1.1261, 0.158299913650614, 1.27391]
    results = tmp_path / "summary.csv"
    summary.to_csv(results, index=False)
    (tmp_path / "summary.json").write_text(json.dumps({"model": "tiny", "machine": {"cpu": "X"}, "rows": []}))
    priced = []
    monkeypatch.setattr(deploy_tab, "deploy_table", lambda *a, **k: priced.append(a) or deploy_table(*a, **k))
    table, csv, _, _ = deploy_tab.views(results, None)
    shown = readable(table).set_index("strategy").loc["conf_adapt:mode=fixed:k=4"]
    assert (shown["speedup"], shown["agreement"], shown["tokens per forward"]) == ("1.13", "15.8%", "1.27")
    assert shown["identical to AR"] == "0.0%" and shown["math accuracy"] == "—"  # not measured: blank
    full = pd.read_csv(csv).set_index("strategy").loc["conf_adapt:mode=fixed:k=4"]
    assert (full["speedup"], full["agreement"], full["tokens per forward"]) == (1.1261, 0.158299913650614, 1.27391)
    assert deploy_tab.views(results, None)[1] == csv and len(priced) == 1  # the same file, priced once
    summary.to_csv(results, index=False)  # a new version of the file
    os.utime(results, ns=(results.stat().st_atime_ns, results.stat().st_mtime_ns + 10**9))
    deploy_tab.views(results, None)
    assert len(priced) == 2


def test_readable_rounds_each_kind_of_figure_and_leaves_labels_and_whole_numbers():
    from mtp_viz.ui.readable import readable

    table = pd.DataFrame(
        {
            "strategy": ["a", "b"],
            "concurrency": [1, 16],
            "predicted, 8 users": [0.98765, float("nan")],
            "prediction_error": [0.1234, -0.05],
            "identical_to_ar": [1.0, 0.5],
            "extra_params": [1234567.0, float("nan")],
            "extra_memory_mb": [12.345, 0.0],
            "ttft_s": [0.31136648, 0.2],
            "tokens_per_s": [36.17448842493677, 100.0],
            "below 1x from": [8, "—"],
        }
    )
    shown = readable(table)
    assert shown.loc[0].tolist() == ["a", "1", "0.99", "+12.3%", "100.0%", "1,234,567", "12.3", "0.311", "36.2", 8]
    assert shown.loc[1].tolist() == ["b", "16", "—", "-5.0%", "50.0%", "—", "0.0", "0.200", "100.0", "—"]
    assert table.loc[0, "predicted, 8 users"] == 0.98765  # the table itself keeps its digits


def test_a_serving_sweep_without_its_thread_count_names_no_threads(tmp_path):
    from mtp_viz.ui.deploy_tab import serving_views

    _sweep(tmp_path / "sweep", [("autoregressive", 1, 20.0, 1.0, 1.0, 1.0), ("prompt_lookup", 1, 24.0, 1.2, 1.3, 2.0)])
    meta_path = tmp_path / "sweep" / "summary.json"
    meta = json.loads(meta_path.read_text())
    del meta["machine"]["threads"]  # vLLM's log did not say
    meta_path.write_text(json.dumps(meta))
    profile_path = tmp_path / "profile.json"
    _engine_profile(profile_path, {1: {1: 1.0, 2: 1.05}})
    data = json.loads(profile_path.read_text())
    del data["machine"]["threads"]
    profile_path.write_text(json.dumps(data))
    fig, _, _, caption = serving_views(tmp_path / "sweep", profile_path)
    assert "Serving CPU, vLLM 9.9" in fig.layout.title.text and "Engine CPU, vLLM 9.9 steps" in caption
    assert "threads" not in fig.layout.title.text + caption


def test_the_deploy_tab_opens_the_results_the_benchmark_tab_opens():
    """The shipped run with every drafter the model ships (FIRST_RESULTS), then the others that
    have the per-forward figures the load curve needs, then those without."""
    from mtp_viz.ui.deploy_tab import deploy_results
    from mtp_viz.ui.results import FIRST_RESULTS, example_results

    opened = list(deploy_results())
    assert opened[0] == FIRST_RESULTS and sorted(opened) == sorted(example_results())
    has = ["scored_per_forward" in example_results()[name].read_text().split("\n", 1)[0] for name in opened]
    assert has[0] and has == sorted(has, reverse=True), list(zip(opened, has, strict=True))
