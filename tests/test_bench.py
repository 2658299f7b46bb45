"""The benchmark runner on tiny models: same prompts for every strategy, autoregressive as the
baseline, derived tables, files written."""

import json

import pytest

from mtp_viz.__main__ import main
from mtp_viz.bench import load_suite
from mtp_viz.errors import UserError
from mtp_viz.strategies.variants import parse_variant, split_variants


def test_suite_selection():
    math = load_suite("spec-bench", ["math_reasoning"])
    assert len(math) == 80 and all(p.answer is not None and p.answer.lstrip("-").isdigit() for p in math)
    assert math[0].answer == "1000"  # its reference ends "#### 1000"
    prompts = load_suite("spec-bench", ["translation", "coding"], limit=2)
    assert all(p.answer is None for p in prompts)
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
            "translation,math_reasoning",
            "--limit",
            "1",
            "--strategies",
            "speculative,prompt_lookup,speculative:schedule=heuristic",
            "--peers",
            "hf_generate,hf_assisted,hf_prompt_lookup",
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
    record = json.loads((out / "summary.json").read_text())
    assert record["machine"]["cpu"] and record["machine"]["forward"] == "lean" and "compiled" in record["machine"]
    overall = {r["strategy"]: r for r in record["rows"] if r["category"] == "overall"}
    labels = {"speculative", "prompt_lookup", "speculative:schedule=heuristic"}
    peers = {"hf_generate", "hf_assisted", "hf_prompt_lookup"}
    assert set(overall) == {"autoregressive"} | labels | peers
    assert overall["autoregressive"]["speedup"] == 1.0 and overall["autoregressive"]["mean_accepted_tokens"] == 1.0
    assert all(overall[s]["identical_share"] == 1.0 for s in labels | peers)  # all lossless, greedy
    assert all(overall[p]["mean_accepted_tokens"] is None for p in peers)  # no trace, no forward count
    assert overall["autoregressive"]["math_answer_match"] == 1.0
    # quality: the original model's NLL of each output (lossless: the same as AR's), reference answers
    assert overall["autoregressive"]["target_nll"] > 0
    assert all(overall[s]["target_nll"] == pytest.approx(overall["autoregressive"]["target_nll"]) for s in labels)
    math_row = {r["strategy"]: r for r in record["rows"] if r["category"] == "math_reasoning"}["autoregressive"]
    assert math_row["math_accuracy"] == 0.0  # a tiny random model does not solve GSM8K
    assert len(overall["speculative"]["per_position_acceptance"]) == 3
    assert len(list((out / "traces" / "speculative").glob("*.json"))) == 2
    assert len(list((out / "traces" / "speculative_schedule-heuristic").glob("*.json"))) == 2
    assert (out / "results.csv").read_text().count("\n") == 1 + 7 * 2
    assert "overall" in capsys.readouterr().out


def test_variants_split_on_commas_that_start_a_strategy():
    text = "autoregressive,mtp_heads:tree=0,1,00:acceptance=typical,speculative:num_draft_tokens=2,prompt_lookup"
    variants = split_variants(text)
    assert variants == [
        "autoregressive",
        "mtp_heads:tree=0,1,00:acceptance=typical",
        "speculative:num_draft_tokens=2",
        "prompt_lookup",
    ]
    assert parse_variant(variants[1]) == ("mtp_heads", {"tree": "0,1,00", "acceptance": "typical"})
    assert split_variants(" autoregressive,,prompt_lookup, ") == ["autoregressive", "prompt_lookup"]
    with pytest.raises(UserError, match="unknown strategy"):
        parse_variant(split_variants("telepathy,1")[0])
