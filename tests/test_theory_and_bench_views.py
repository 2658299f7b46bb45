"""The Theory and Benchmark tabs' pure parts: measured points from traces, profile and summary
uploads (bad files refused with a message), and the figures they draw."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import tiny_model

from mtp_viz.errors import UserError
from mtp_viz.loading import early_exit_view
from mtp_viz.machine import machine_label
from mtp_viz.profile import exit_agreement, read_profile
from mtp_viz.theory import measured_point
from mtp_viz.trace import Trace
from mtp_viz.ui.bench_tab import views
from mtp_viz.ui.results import (
    FIRST_PROFILE,
    FIRST_RESULTS,
    example_results,
    example_traces,
    first,
    read_summary,
    shipped_profiles,
)
from mtp_viz.ui.theory_tab import numbers_html, points_from
from mtp_viz.viz import figures


def test_measured_point_from_a_run_and_its_baseline():
    examples = {k: Trace.load(p) for k, p in example_traces().items()}
    base, lookup = examples["autoregressive-code-edit"], examples["prompt-lookup-code-edit"]
    p = measured_point(lookup, base)
    s = lookup.summary
    assert p["speedup"] == pytest.approx(s["tokens_per_s"] / base.summary["tokens_per_s"])
    assert 0 < p["alpha"] <= 1 and p["gamma"] >= 1
    assert measured_point(base, base) is None  # nothing drafted
    assert measured_point(lookup, None) is None


def test_theory_numbers_and_curves():
    for path in shipped_profiles().values():  # every shipped curve names the machine it was measured on
        recorded = json.loads(Path(path).read_text())["machine"]
        assert read_profile(path).label.startswith(machine_label(recorded)) and recorded.get("cpu")
    shipped = read_profile(next(iter(shipped_profiles().values())))
    curve = shipped.curve
    assert curve[1] == 1.0 and len(curve) >= 16
    html = numbers_html(0.8, 8, 0.05, None)
    assert "<b>4.33</b>" in html and "<b>3.09x</b>" in html and "best γ = 8" in html  # Leviathan's worked values
    points = points_from([str(p) for p in example_traces().values()])
    fig = figures.theory_curves(0.8, 0.05, [(shipped.label, curve)], points)
    assert len(fig.data) == 5  # textbook, measured cost, the three recorded runs that drafted
    assert sorted(d.name for d in fig.data[2:]) == [
        "eagle (smollm2-135m-eagle3)",
        "mtp_heads (smollm2-135m-mtp)",
        "prompt_lookup",
    ]
    mine = {k: v * 1.1 for k, v in curve.items()}
    two = figures.theory_curves(0.8, 0.05, [("here", mine), (shipped.label, curve)], points)
    assert [d.name for d in two.data[1:3]] == ["measured verify cost: here", f"measured verify cost: {shipped.label}"]


def test_bad_uploads_are_refused_with_a_message(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    with pytest.raises(UserError, match="not a profile"):
        read_profile(bad)
    csv = tmp_path / "summary.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="columns"):
        read_summary(csv)
    binary = tmp_path / "x.csv"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(UserError):
        read_summary(binary)


def test_bench_views_from_a_summary(tmp_path):
    summary = pd.DataFrame(
        {
            "category": ["qa", "qa", "overall", "overall"],
            "strategy": ["autoregressive", "conf_adapt", "autoregressive", "conf_adapt"],
            "tokens_per_s": [10.0, 20.0, 10.0, 18.0],
            "speedup": [1.0, 2.0, 1.0, 1.8],
            "mean_accepted_tokens": [1.0, 2.5, 1.0, 2.3],
            "agreement": [1.0, 0.6, 1.0, 0.7],
        }
    )
    path = tmp_path / "summary.csv"
    summary.to_csv(path, index=False)
    table, speed, accepted, pareto, lossy = views(read_summary(path))
    assert list(table["strategy"]) == ["conf_adapt", "autoregressive"]  # one row per strategy, fastest first
    assert list(table.columns[:6]) == [
        "strategy",
        "kind",
        "speedup",
        "tokens per forward",
        "identical to AR",
        "agreement",
    ]
    assert table.loc[0, "qa speedup"] == 2.0
    assert [d.name for d in speed.data] == ["conf_adapt"]  # autoregressive is the 1.0 line, not a series
    assert [d.name for d in pareto.data] == ["conf_adapt"] and pareto.data[0].mode == "markers"
    # the lossy trade-off: the ConfAdapt line (agreement: no math prompts here), the lossless points,
    # and the paper's published points as reference marks
    names = [d.name for d in lossy.data]
    assert names[0] == "conf_adapt (each variant)" and list(lossy.data[0].y) == [0.7]
    assert "lossless strategies" in names and sum("paper:" in n for n in names) == 2
    assert "agreement" in lossy.layout.title.text


def test_bench_figures_stay_readable_with_many_variants():
    """Twenty variants: the figures draw the best of each family (≤ MAX_SERIES), coloured by family,
    with the legend below the plot; the table still lists every one; peers are marked."""
    labels = ["autoregressive", "hf_generate", "hf_assisted"] + [
        f"speculative:num_draft_tokens={k}" for k in range(1, 9)
    ]
    labels += [f"mtp_heads:v={k}" for k in range(5)] + ["prompt_lookup", "lookahead", "self_speculative", "conf_adapt"]
    rows = []
    for i, label in enumerate(labels):
        for category in ("qa", "rag", "overall"):
            speed = 1.0 if label == "autoregressive" else 0.5 + i / 20
            rows.append(
                dict(
                    category=category,
                    strategy=label,
                    tokens_per_s=speed * 10,
                    speedup=speed,
                    mean_accepted_tokens=1.2,
                    agreement=1.0,
                    identical_share=1.0,
                )
            )
    summary = pd.DataFrame(rows)
    best = figures.best_variants(summary)
    assert len(best) <= figures.MAX_SERIES and len({figures.family(b) for b in best if not b.startswith("hf_")}) == len(
        [b for b in best if not b.startswith("hf_")]
    )
    assert "mtp_heads:v=4" in best and "speculative:num_draft_tokens=8" in best and "hf_assisted" in best
    table, speed, accepted, pareto, lossy = views(summary, best)
    assert len(table) == len(labels) and set(table.loc[table["strategy"].str.startswith("hf_"), "kind"]) == {
        "peer (transformers)"
    }
    for fig in (speed, accepted, pareto, lossy):
        assert len(fig.data) <= figures.MAX_SERIES
        assert fig.layout.legend.y < 0  # below the plot, never over the bars
    assert all(bar.y is not None and len(bar.y) == 3 for bar in speed.data)  # every category drawn


def test_exit_agreement_matches_the_early_exit_drafts():
    """Layer L's figure is exactly how often the registry's early exit of L layers (what
    self_speculative drafts with) picks the full model's next token; the last layer agrees always."""
    model = tiny_model("llama-3l-mha", seed=2, vocab_size=16, initializer_range=0.4)
    with torch.no_grad():  # a final norm that is not a plain rescaling, so applying it matters
        model.model.norm.weight.copy_(torch.linspace(0.1, 3.0, model.config.hidden_size))
    ids = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 3, 1, 2, 9, 9, 4]]
    agreement = exit_agreement(model, [(s, 3) for s in ids])
    assert sorted(agreement) == [1, 2, 3] and agreement[3] == 1.0
    with torch.no_grad():
        for layer in (1, 2):
            exit_model = early_exit_view(model, layer)
            same = total = 0
            for s in ids:
                x = torch.tensor([s])
                full, short = model(x).logits[0, 2:-1].argmax(-1), exit_model(x).logits[0, 2:-1].argmax(-1)
                same, total = same + int((full == short).sum()), total + len(full)
            assert agreement[layer] == pytest.approx(same / total)
    assert min(agreement.values()) > 0 and min(agreement.values()) < 1  # the tiny exits disagree sometimes
    fig = figures.exit_agreement_bars(agreement)
    assert list(fig.data[0].x) == [1, 2, 3]


def test_theory_tab_reads_exit_agreement_from_a_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"verify_cost": {"1": 1.0, "2": 1.5}, "exit_agreement": {"1": 0.1, "2": 1.0}}))
    assert read_profile(path).exits == {1: 0.1, 2: 1.0}
    path.write_text(json.dumps({"verify_cost": {"1": 1.0}}))  # profiles from before it was measured
    assert read_profile(path).exits is None
    assert read_profile(path).label == "machine not recorded"
    assert len(figures.exit_agreement_bars(None).data) == 0


def test_shipped_bench_results_and_profile_load_in_the_tabs():
    """What the Benchmark and Theory tabs open by default: the CPU results measured on the
    embedded model, with autoregressive as the baseline, and the profile with its exit agreement."""
    shipped = example_results()
    assert "cpu-smollm2-135m" in shipped
    summary = read_summary(shipped["cpu-smollm2-135m"])
    base = summary[summary["strategy"] == "autoregressive"]
    assert set(base["speedup"]) == {1.0} and "overall" in set(summary["category"])
    table, speed, accepted, pareto, lossy = views(summary)
    assert 1 <= len(speed.data) <= figures.MAX_SERIES and len(table) == summary["strategy"].nunique()
    exits = read_profile(shipped_profiles()["profile-smollm2-135m-cpu"]).exits
    assert len(exits) == 30 and exits[30] == 1.0
    # the tabs open first what the engine runs by default on a CPU: the q4 results and profile
    opened = first(shipped, FIRST_RESULTS)
    assert next(iter(opened)) == FIRST_RESULTS
    q4 = read_summary(opened[FIRST_RESULTS])
    lossless = q4[(q4["category"] == "overall") & q4["strategy"].isin(["prompt_lookup", "speculative", "mtp_heads"])]
    assert len(lossless) == 3 and set(lossless["identical_share"]) == {1.0}
    assert len(views(q4)[0]) == q4["strategy"].nunique()
    profiles = first(shipped_profiles(), FIRST_PROFILE)
    assert next(iter(profiles)) == FIRST_PROFILE
    q4_profile = read_profile(profiles[FIRST_PROFILE])
    assert len(q4_profile.exits) == 30 and "q4" in q4_profile.label


def test_bench_results_name_their_machine(tmp_path):
    from mtp_viz.ui.results import measured_on

    csv = tmp_path / "summary.csv"
    assert "not recorded" in measured_on(csv)
    (tmp_path / "summary.json").write_text(json.dumps({"machine": {"cpu": "Some CPU", "threads": 2}, "rows": []}))
    assert "Some CPU, 2 threads" in measured_on(csv)
    (tmp_path / "summary.json").write_text("[]")  # the list older benches wrote
    assert "not recorded" in measured_on(csv)
