"""`profile --backend vllm` and `bench --backend vllm --schedule` end to end against the stand-in
server (tests/fake_vllm.py): what is asked of vLLM, what is written, and that every server stops."""

import json

import pandas as pd
from conftest import gone
from fake_vllm import HASHED

from mtp_viz.__main__ import main
from mtp_viz.profile import read_profile
from mtp_viz.serving.engine_profile import DRAFTS
from mtp_viz.serving.sweep import read_sweep, trace_folder
from mtp_viz.trace import Trace


def test_profile_on_vllm_writes_the_engines_step_costs_in_the_profile_format(fake_vllm, use_tiny_registry, tmp_path):
    out = tmp_path / "profile.json"
    assert main(["profile", "--backend", "vllm", "--model", "tiny", "--batch-sizes", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["engine"] == "vllm" and data["machine"]["engine"] == "vllm" and data["machine"]["vllm"] == "fake"
    forced = data["machine"]["forced_drafts"]
    assert forced["method"] == "custom_class" and forced["num_speculative_tokens"] == max(DRAFTS)
    assert sorted(map(int, data["batch_cost"])) == [1, 2]
    assert sorted(map(int, data["batch_cost"]["1"])) == [d + 1 for d in DRAFTS]
    assert all(v["1"] == 1.0 for v in data["batch_cost"].values()) and set(data["step_fit"]) >= {"fixed_s"}
    view = read_profile(out)
    assert view.engine == "vllm" and view.label.endswith(", vLLM fake steps")
    assert view.batch_cost[2][8] > 0 and view.one_token_s[1] > 0 and sorted(view.curve) == list(range(1, 9))
    assert gone(json.loads(fake_vllm.read_text()))


def test_bench_serves_a_schedule_beside_the_fixed_length_and_plain_decoding(
    fake_vllm, use_tiny_registry, tmp_path, monkeypatch
):
    """The scheduled server is asked what plain decoding was asked: the stand-in answers each prompt
    differently (a hash of the request), so an answer to another request is not identical."""
    monkeypatch.setenv("FAKE_VLLM_TOKENS", HASHED)
    out = tmp_path / "sweep"
    args = ["bench", "--backend", "vllm", "--model", "tiny", "--strategies", "prompt_lookup", "--limit", "2"]
    args += ["--categories", "writing", "--max-new-tokens", "3", "--concurrency", "1,2", "--no-compare-ours"]
    assert main([*args, "--schedule", "1-1:2,2-32:0", "--out", str(out)]) == 0
    table, meta = read_sweep(out)
    label = "prompt_lookup:per_batch=1-1:2,2-32:0"
    assert list(dict.fromkeys(table["strategy"])) == ["autoregressive", "prompt_lookup", label]
    assert meta["schedules"][label] == {
        "from": "prompt_lookup",
        "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 32, 0]],
        "crossover": 2,
        "plain_from": None,  # a table given by hand: no recommendation, no plain serving
        "predicted": {},
        "served": True,
        "recommended": None,
    }
    config = json.loads(
        meta["servers"][label]["args"][meta["servers"][label]["args"].index("--speculative-config") + 1]
    )
    assert config["num_speculative_tokens"] == 2 and config["method"] == "ngram"
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 32, 0]]
    plain = [Trace.load(t).output_token_ids for t in sorted(trace_folder(out, "autoregressive", 1).iterdir())]
    assert len(plain) == 2 and plain[0] != plain[1]  # two prompts, two answers: identity can fail
    assert (table.loc[table["strategy"] == label, "identical_to_ar"] == 1.0).all()
    assert gone(json.loads(fake_vllm.read_text()))


def test_a_schedule_that_never_drafts_is_not_served(fake_vllm, use_tiny_registry, tmp_path):
    args = ["bench", "--backend", "vllm", "--model", "tiny", "--strategies", "prompt_lookup", "--limit", "1"]
    args += ["--categories", "writing", "--max-new-tokens", "3", "--concurrency", "1", "--no-compare-ours"]
    assert main([*args, "--schedule", "1-32:0", "--out", str(tmp_path / "b")]) == 0
    table, meta = read_sweep(tmp_path / "b")
    assert meta["schedules"]["prompt_lookup:per_batch=1-32:0"]["served"] is False
    assert set(table["strategy"]) == {"autoregressive", "prompt_lookup"} and isinstance(table, pd.DataFrame)


def test_auto_without_a_profile_measures_this_machines_once_as_served_and_serves_every_fixed_length(
    fake_vllm, use_tiny_registry, tmp_path, monkeypatch, capsys
):
    """The profile is measured on the stand-in (its timings mean nothing; what is asked and kept is
    the point), cached, and read back by the next sweep; the stand-in reports no acceptance, so the
    schedule itself is refused with a clear message after the fixed lengths were measured."""
    monkeypatch.setenv("MTP_VIZ_CACHE", str(tmp_path / "cache"))
    args = ["bench", "--backend", "vllm", "--model", "tiny", "--strategies", "prompt_lookup:num_draft_tokens=2"]
    args += ["--limit", "1", "--categories", "writing,coding", "--max-new-tokens", "3", "--concurrency", "1,2"]
    args += ["--no-compare-ours", "--schedule", "auto"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 2
    first = capsys.readouterr()
    assert "prompt_lookup:num_draft_tokens=2 measured no acceptance to schedule from" in first.err
    assert "measuring this machine's vLLM profile once" in first.out + first.err
    (kept,) = (tmp_path / "cache" / "profiles").glob("*.json")
    view = read_profile(kept)
    assert sorted(view.served.plain) == [1, 2] and sorted(view.served.forced) == [1, 2, 3, 4, 6]
    assert view.served.new_tokens == 3 and "served" in json.loads(kept.read_text())["how"]
    table, meta = read_sweep(tmp_path / "a")
    assert meta["profile"] == str(kept)
    assert {"autoregressive", "prompt_lookup:num_draft_tokens=1", "prompt_lookup:num_draft_tokens=2"} <= set(
        table["strategy"]
    )
    assert main([*args, "--out", str(tmp_path / "b")]) == 2
    second = capsys.readouterr()
    assert "measuring this machine's" not in second.out + second.err
    assert list((tmp_path / "cache" / "profiles").glob("*.json")) == [kept]
    assert gone(json.loads(fake_vllm.read_text()))
