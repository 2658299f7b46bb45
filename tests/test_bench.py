"""The benchmark runner on tiny models: same prompts for every strategy, autoregressive as the
baseline, derived tables, files written."""

import json

import pytest

from mtp_viz.__main__ import main
from mtp_viz.bench import load_suite
from mtp_viz.errors import UserError


def test_suite_selection():
    prompts = load_suite("spec-bench", ["translation", "coding"], limit=2)
    assert sorted(p.category for p in prompts) == ["coding", "coding", "translation", "translation"]
    assert len(load_suite("spec-bench")) == 480
    with pytest.raises(UserError, match="unknown categories"):
        load_suite("spec-bench", ["poetry"])
    with pytest.raises(UserError, match="unknown suite"):
        load_suite("mt-bench")


def test_bench_command_writes_tables_and_traces(use_tiny_registry, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "--categories",
            "translation,coding",
            "--limit",
            "1",
            "--strategies",
            "speculative,prompt_lookup",
            "--model",
            "tiny",
            "--max-new-tokens",
            "8",
            "--num-draft-tokens",
            "3",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    overall = {r["strategy"]: r for r in summary if r["category"] == "overall"}
    assert set(overall) == {"autoregressive", "speculative", "prompt_lookup"}
    assert overall["autoregressive"]["speedup"] == 1.0 and overall["autoregressive"]["mean_accepted_tokens"] == 1.0
    assert overall["speculative"]["identical_share"] == 1.0 and overall["prompt_lookup"]["identical_share"] == 1.0
    assert len(list((out / "traces" / "speculative").glob("*.json"))) == 2
    assert (out / "results.csv").read_text().count("\n") == 1 + 3 * 2
    assert "overall" in capsys.readouterr().out
